"""Held-out score: greedy completions of the run's held-out prompts (never trained on), graded by the
dataset (rl/data.py; the built-in task: exact-answer accuracy)."""

from __future__ import annotations

import torch

from seekforge.config import EngineConfig
from seekforge.rl.collectives import distributed, sum_over_ranks
from seekforge.rl.config import GRPOConfig
from seekforge.rl.data import ArithmeticPrompts, PromptDataset, Sample
from seekforge.rl.rollout import Rollout, encode_prompt


@torch.no_grad()
def evaluate(rollout: Rollout, tokenizer, dataset: PromptDataset, max_new_tokens: int) -> float:
    """On the training engine; under torchrun every rank grades its slice. NaN without held-out prompts."""
    eval_set = dataset.eval_set
    if not eval_set:
        return float("nan")
    mine = eval_set
    if distributed():
        import torch.distributed as dist

        mine = eval_set[dist.get_rank()::dist.get_world_size()]
    total = _total_grade(rollout, tokenizer, dataset, mine, max_new_tokens)
    return sum_over_ranks({"total": total})["total"] / len(eval_set)


def held_out_accuracy(model, tokenizer, cfg: GRPOConfig) -> float:
    """The built-in task's, on a throwaway engine in one process (the built-in base model's, while it pretrains)."""
    rollout = Rollout(model, tokenizer, EngineConfig(kv_cache_memory=cfg.kv_cache_memory,
                                                     max_num_seqs=max(1, cfg.eval_prompts)))
    dataset = ArithmeticPrompts(cfg.task_levels, cfg.seed, cfg.eval_prompts)
    return _total_grade(rollout, tokenizer, dataset, dataset.eval_set, cfg.max_new_tokens) / \
        max(len(dataset.eval_set), 1)


def _total_grade(rollout: Rollout, tokenizer, dataset: PromptDataset, samples: list[Sample],
                 max_new_tokens: int) -> float:
    ids = [encode_prompt(tokenizer, sample.prompt) for sample in samples]
    completions = rollout.generate(ids, 1, max_new_tokens, temperature=0.0) if ids else []
    return float(sum(dataset.grade(sample, tokenizer.decode(c))
                     for c, sample in zip(completions, samples, strict=True)))
