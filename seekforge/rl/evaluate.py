"""Held-out accuracy: greedy completions of the run's held-out prompts (never trained on), graded by
the task."""

from __future__ import annotations

import torch

from seekforge.config import EngineConfig
from seekforge.data.corpora import check_answer
from seekforge.rl.collectives import distributed, sum_over_ranks
from seekforge.rl.config import GRPOConfig
from seekforge.rl.data import PromptStream
from seekforge.rl.rollout import Rollout, encode_prompt


@torch.no_grad()
def evaluate(rollout: Rollout, tokenizer, eval_set: list[tuple[str, str]], max_new_tokens: int) -> float:
    """On the training engine; under torchrun every rank grades its slice. NaN without held-out prompts."""
    if not eval_set:
        return float("nan")
    mine = eval_set
    if distributed():
        import torch.distributed as dist

        mine = eval_set[dist.get_rank()::dist.get_world_size()]
    return sum_over_ranks({"correct": _num_correct(rollout, tokenizer, mine, max_new_tokens)})["correct"] / \
        len(eval_set)


def held_out_accuracy(model, tokenizer, cfg: GRPOConfig) -> float:
    """On a throwaway engine, in one process (the built-in base model's, while it pretrains)."""
    rollout = Rollout(model, tokenizer, EngineConfig(kv_cache_memory=cfg.kv_cache_memory,
                                                     max_num_seqs=max(1, cfg.eval_prompts)))
    eval_set = PromptStream(cfg.task_levels, cfg.seed, cfg.eval_prompts).eval_set
    return _num_correct(rollout, tokenizer, eval_set, cfg.max_new_tokens) / max(len(eval_set), 1)


def _num_correct(rollout: Rollout, tokenizer, samples: list[tuple[str, str]], max_new_tokens: int) -> float:
    ids = [encode_prompt(tokenizer, prompt) for prompt, _ in samples]
    completions = rollout.generate(ids, 1, max_new_tokens, temperature=0.0) if ids else []
    return float(sum(check_answer(tokenizer.decode(c), answer)
                     for c, (_, answer) in zip(completions, samples, strict=True)))
