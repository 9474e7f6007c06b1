"""The score step (rl/score.py): each reward's values over the whole batch → the weighted, None-ignoring
reward per completion, group advantages, and the metrics users expect (TRL's names): each reward's mean and
std, completion lengths and the share cut off at the budget."""

from __future__ import annotations

import math

import pytest
import torch

from seekforge.model.tokenizer import load_tokenizer
from seekforge.rl.data import Sample
from seekforge.rl.rewards import RewardError, RewardSet
from seekforge.rl.score import score_groups


def first_digit(prompts, completions, **columns):
    """None where the completion has no digit."""
    return [float(c.strip()[0]) if c.strip()[:1].isdigit() else None for c in completions]


def fails(prompt, completion, **columns):
    raise KeyError("label")


def test_score_groups_metrics():
    tokenizer = load_tokenizer("byte")
    eos = tokenizer.eos_token_id
    samples = [Sample("a", {}), Sample("b", {})]
    texts = [" 1", "xx", " 3", " 9"]  # group 0: " 1", "xx"; group 1: " 3", " 9"
    local = [tokenizer.encode(t) + [eos] for t in texts]
    local[1] = tokenizer.encode("xxxx")  # cut off at the budget of 4: no stop token
    rewards = RewardSet([f"{__name__}:first_digit", "format"], [1.0, 2.0], max_new_tokens=4)
    scored = score_groups(rewards, tokenizer, samples, [0, 1], local, group_size=2, scale_rewards=True)
    assert scored.rewards.tolist() == [3.0, 0.0, 5.0, 11.0]  # None (no digit) left out of the sum
    assert math.isnan(scored.values[1, 0]) and scored.values[:, 1].tolist() == [1.0, 0.0, 1.0, 1.0]
    m = scored.metrics
    assert m["rewards/first_digit/mean"] == pytest.approx(13 / 3)
    assert m["rewards/first_digit/std"] == pytest.approx(torch.tensor([1.0, 3.0, 9.0]).std().item())
    assert m["rewards/format/mean"] == 0.75 and m["reward_mean"] == pytest.approx(19 / 4) and m["reward_errors"] == 0
    assert (m["completions/min_length"], m["completions/max_length"], m["completions/clipped_ratio"]) == (3, 4, 0.25)
    assert scored.advantages.view(2, 2)[:, 0].gt(0).tolist() == [True, False]


def test_a_failing_reward_stops_the_step_with_its_name():
    tokenizer = load_tokenizer("byte")
    rewards = RewardSet([f"{__name__}:fails"], [1.0])
    with pytest.raises(RewardError, match=r"reward 'tests.rl.test_score:fails' raised KeyError: 'label'"):
        score_groups(rewards, tokenizer, [Sample("a", {})], [0], [[65], [66]], group_size=2, scale_rewards=True)
