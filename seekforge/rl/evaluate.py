"""Held-out score: completions of the run's held-out prompts (never trained on), graded by the dataset's
grader (the built-in task: its exact answer; a user's data: the run's first reward, rl/data.py).

  eval_accuracy  greedy completions' mean grade (a 0/1 reward: the share answered right); None grades are
                 left out
  eval_pass@k    (GRPOConfig.eval_k = k > 0) k completions per prompt sampled at the rollout temperature: the
                 share of prompts with a passing one (grade >= eval_pass_score), by the unbiased estimator of
                 Chen et al. 2021 (with n = k samples it is exactly that share). The sampling seeds are the same at
                 every evaluation, so the curve follows the model, not the draw.
"""

from __future__ import annotations

import math

import torch

from seekforge.config import EngineConfig
from seekforge.rl.collectives import distributed, first_error_over_ranks, sum_over_ranks
from seekforge.rl.config import GRPOConfig
from seekforge.rl.data import ArithmeticPrompts, PromptDataset, Sample
from seekforge.rl.rewards import RewardError, RewardSet
from seekforge.rl.rollout import Rollout, encode_prompt

_EVAL_SEED_OFFSET = 2**40  # past every training step's rollout seeds (rl/rollout.rollout_seeds)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c pass (Chen et al. 2021, eq. 1):
    1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without replacement include a passing one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(rollout: Rollout, tokenizer, dataset: PromptDataset, cfg: GRPOConfig) -> dict[str, float]:
    """On the training engine; under torchrun every rank grades its slice. eval_accuracy NaN without
    held-out prompts."""
    eval_set = dataset.eval_set
    if not eval_set:
        return {"eval_accuracy": float("nan")}
    k = cfg.eval_k
    seeds = [(cfg.seed * 1_000_003 + i) * max(k, 1) + _EVAL_SEED_OFFSET for i in range(len(eval_set))]
    mine = list(range(len(eval_set)))
    if distributed():
        import torch.distributed as dist

        mine = mine[dist.get_rank()::dist.get_world_size()]
    grader = RewardSet([dataset.grader or cfg.rewards[0]], [1.0], cfg.reward_errors, cfg.max_new_tokens)
    samples = [eval_set[i] for i in mine]
    totals, failure = {"sum": 0.0, "graded": 0.0, "passed": 0.0}, None
    try:
        greedy = grades(rollout, tokenizer, grader, samples, 1, cfg.max_new_tokens, 0.0)
        applied = [g[0] for g in greedy if not math.isnan(g[0])]
        totals.update(sum=sum(applied), graded=len(applied))
        if k:
            sampled = grades(rollout, tokenizer, grader, samples, k, cfg.max_new_tokens, cfg.temperature,
                             [seeds[i] for i in mine])
            totals["passed"] = sum(pass_at_k(k, sum(g >= cfg.eval_pass_score for g in row), k) for row in sampled)
    except RewardError as e:
        failure = (e.reward, str(e))
    failure = first_error_over_ranks(failure)  # every rank stops alike (a collective save follows)
    if failure is not None:
        raise RewardError(*failure)
    totals = sum_over_ranks(totals)
    out = {"eval_accuracy": totals["sum"] / totals["graded"] if totals["graded"] else float("nan")}
    if k:
        out[f"eval_pass@{k}"] = totals["passed"] / len(eval_set)
    return out


def held_out_accuracy(model, tokenizer, cfg: GRPOConfig) -> float:
    """The built-in task's, on a throwaway engine in one process (the built-in base model's, while it pretrains)."""
    rollout = Rollout(model, tokenizer, EngineConfig(kv_cache_memory=cfg.kv_cache_memory,
                                                     max_num_seqs=max(1, cfg.eval_prompts)))
    dataset = ArithmeticPrompts(cfg.task_levels, cfg.seed, cfg.eval_prompts)
    grader = RewardSet([dataset.grader], [1.0])
    scores = grades(rollout, tokenizer, grader, dataset.eval_set, 1, cfg.max_new_tokens, 0.0)
    return sum(row[0] for row in scores) / max(len(dataset.eval_set), 1)


def grades(rollout: Rollout, tokenizer, grader: RewardSet, samples: list[Sample], n: int, max_new_tokens: int,
           temperature: float, seeds: list[int] | None = None) -> list[list[float]]:
    """n completions of each sample → the grader's value of each: [sample][completion] (NaN: None)."""
    if not samples:
        return []
    ids = [encode_prompt(tokenizer, sample.prompt) for sample in samples]
    completions = rollout.generate(ids, n, max_new_tokens, temperature=temperature, seeds=seeds)
    values, _ = grader.score([s.prompt for s in samples for _ in range(n)], [tokenizer.decode(c) for c in completions],
                             [s.meta for s in samples for _ in range(n)], completions)
    return [[values[i * n + j][0] for j in range(n)] for i in range(len(samples))]
