"""GRPO's score step: the rollout's completions → rewards → group advantages, and the step's reward and
completion metrics.

Each rank scores the completions it generated (the reward functions may be slow: user code, rl/rewards.py),
then every rank learns every group's completions and each reward's values (token ids and floats: small), so
advantages and metrics are computed over whole groups and the training split can follow the actual sequence
lengths. A reward that fails under reward_errors="raise" stops every rank alike, with the failing rank's
message.

Metrics (TRL's names where TRL has the metric): reward_mean / reward_std (the weighted sum), rewards/<name>/mean
and /std (each reward alone, over the completions it applied to), zero_std_groups, reward_errors,
completions/min_length, /max_length, /clipped_ratio (hit max_new_tokens without a stop token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from seekforge.rl.algorithm import group_advantages
from seekforge.rl.collectives import all_groups, first_error_over_ranks
from seekforge.rl.data import Sample
from seekforge.rl.rewards import RewardError, RewardSet


@dataclass
class ScoredBatch:
    """The whole step's sequences, group-major: sequence g·G + j is completion j of prompt g."""

    completions: list[list[int]]  # token ids
    rewards: torch.Tensor  # (N,) the weighted sum
    advantages: torch.Tensor  # (N,)
    metrics: dict[str, float]  # see the module's docstring
    values: torch.Tensor  # (N, R) float64: each reward's value, NaN where it did not apply


def score_groups(rewards: RewardSet, tokenizer, samples: list[Sample], mine: list[int], local: list[list[int]],
                 group_size: int, scale_rewards: bool) -> ScoredBatch:
    """samples: the step's prompts; mine, local: this rank's prompt indices and their completions
    (rl/rollout.sample_groups). The rewards see each prompt's other columns (Sample.meta)."""
    G = group_size
    texts = [tokenizer.decode(c) for c in local]
    prompts = [samples[i].prompt for i in mine for _ in range(G)]
    metas = [samples[i].meta for i in mine for _ in range(G)]
    values, errors, failure = [], 0, None
    try:
        values, errors = rewards.score(prompts, texts, metas, local)
    except RewardError as e:
        failure = (e.reward, str(e))
    failure = first_error_over_ranks(failure)
    if failure is not None:
        raise RewardError(*failure)
    completions, all_values, errors = all_groups(mine, local, values, errors, len(samples), G)
    weights = torch.tensor(rewards.weights, dtype=torch.float64)
    all_rewards = (all_values * weights).nansum(dim=1).float()  # a reward's None (NaN) is left out, as TRL's nansum
    if all_values.isnan().all(dim=1).any():
        rewards.warn_once("no reward applied to some completions (every reward returned None): they score 0")
    by_group = all_rewards.view(-1, G)
    metrics = dict(reward_mean=all_rewards.mean().item(), reward_std=all_rewards.std().item(),
                   zero_std_groups=(by_group.std(dim=1) == 0).float().mean().item(), reward_errors=errors)
    for r, name in enumerate(rewards.names):
        metrics.update(reward_statistics(all_values[:, r], f"rewards/{name}"))
    metrics.update(length_statistics(completions, rewards.max_new_tokens, tokenizer.eos_token_id))
    return ScoredBatch(completions, all_rewards, group_advantages(all_rewards, G, scale_rewards), metrics, all_values)


def reward_statistics(column: torch.Tensor, prefix: str) -> dict[str, float]:
    """Mean and (unbiased) std over the completions the reward applied to; NaN where it applied to none."""
    applied = column[~column.isnan()]
    return {f"{prefix}/mean": applied.mean().item() if len(applied) else math.nan,
            f"{prefix}/std": applied.std().item() if len(applied) > 1 else math.nan}


def length_statistics(completions: list[list[int]], max_new_tokens: int | None, eos_id: int | None
                      ) -> dict[str, float]:
    lengths = [len(c) for c in completions]
    out = {"completions/min_length": min(lengths), "completions/max_length": max(lengths)}
    if max_new_tokens is not None:
        clipped = [len(c) >= max_new_tokens and (not c or c[-1] != eos_id) for c in completions]
        out["completions/clipped_ratio"] = sum(clipped) / len(clipped)
    return out
