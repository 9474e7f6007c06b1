"""The held-out evaluation (rl/evaluate.py): pass@k's unbiased estimator, and evaluate() on fixed completions:
greedy accuracy from the greedy ones, pass@k from k sampled ones at the rollout temperature with seeds that
are the same at every evaluation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from seekforge.model.tokenizer import load_tokenizer
from seekforge.rl.config import GRPOConfig
from seekforge.rl.data import Sample
from seekforge.rl.evaluate import evaluate, pass_at_k


def test_pass_at_k_is_chen_et_al_unbiased_estimator():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    # the estimator is the mean over all k-subsets of "some member passes"
    from itertools import combinations
    passes = [1, 0, 0, 1, 0, 0]
    subsets = list(combinations(passes, 3))
    assert pass_at_k(6, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="need 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(2, 0, 3)


class ScriptedRollout:
    """Completions by (prompt, temperature): greedy ones, and k sampled ones per prompt."""

    def __init__(self, tokenizer, greedy: dict[str, str], sampled: dict[str, list[str]]):
        self.tokenizer, self.greedy, self.sampled, self.calls = tokenizer, greedy, sampled, []

    def generate(self, prompts, n, max_tokens, temperature, seeds=None):
        self.calls.append((n, temperature, seeds))
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            answers = [self.greedy[text]] if temperature == 0 else self.sampled[text]
            assert len(answers) == n
            out += [self.tokenizer.encode(a) + [self.tokenizer.eos_token_id] for a in answers]
        return out


def test_evaluate_on_fixed_completions():
    tokenizer = load_tokenizer("byte")
    eval_set = [Sample(f"Q: {i} + 1 = ? A:", {"answer": str(i + 1)}) for i in range(3)]
    greedy = {"Q: 0 + 1 = ? A:": " 1", "Q: 1 + 1 = ? A:": " 3", "Q: 2 + 1 = ? A:": " 3"}
    sampled = {"Q: 0 + 1 = ? A:": [" 2", " 0"], "Q: 1 + 1 = ? A:": [" 5", " 2"], "Q: 2 + 1 = ? A:": [" 3", " 3"]}
    rollout = ScriptedRollout(tokenizer, greedy, sampled)
    dataset = SimpleNamespace(eval_set=eval_set, grader=None)
    cfg = GRPOConfig(eval_k=2, temperature=0.7, seed=3)
    scores = evaluate(rollout, tokenizer, dataset, cfg)
    assert scores == {"eval_accuracy": pytest.approx(2 / 3), "eval_pass@2": pytest.approx(2 / 3)}
    (n_greedy, t_greedy, _), (n, temperature, seeds) = rollout.calls
    assert (n_greedy, t_greedy, n, temperature) == (1, 0.0, 2, 0.7)
    evaluate(rollout, tokenizer, dataset, cfg)
    assert rollout.calls[-1][2] == seeds and len(set(seeds)) == 3  # the same draw at every evaluation
    assert evaluate(rollout, tokenizer, dataset, GRPOConfig(eval_k=0)) == {"eval_accuracy": pytest.approx(2 / 3)}
    # a pass is a grade >= eval_pass_score: with a score the exact answer never reaches, nothing passes
    assert evaluate(rollout, tokenizer, dataset, GRPOConfig(eval_k=2, eval_pass_score=1.5))["eval_pass@2"] == 0.0
