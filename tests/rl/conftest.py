"""A tiny fp32 model and a synthetic rollout batch (prompt groups with completions of mixed lengths)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from seekforge.config import preset
from seekforge.model.model import build_model
from seekforge.rl.algorithm import group_advantages, sequence_weights, token_share
from seekforge.rl.update import TrainingBatch


def tiny_model(seed: int = 0):
    return build_model(preset("tiny"), seed=seed)


def synthetic_rollout(num_prompts: int = 4, group_size: int = 4, seed: int = 0, with_old: bool = True,
                      with_ref: bool = True):
    """→ (prompts, completions, TrainingBatch): prompts repeated per group, completion lengths 1..20."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(num_prompts):
        prompt = torch.randint(0, 256, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(group_size):
            n = int(torch.randint(1, 21, (1,), generator=gen))
            prompts.append(prompt)
            completions.append(torch.randint(0, 256, (n,), generator=gen).tolist())
    rewards = torch.rand(len(completions), generator=gen)
    lengths = [len(c) for c in completions]

    def noise():
        return [-torch.rand(n, generator=gen) * 4 for n in lengths]

    batch = TrainingBatch(lengths, group_advantages(rewards, group_size), noise() if with_old else None,
                          noise() if with_ref else None, torch.zeros(len(lengths)), token_share(torch.tensor(lengths)))
    return prompts, completions, weighted(batch, "grpo")


def weighted(batch: TrainingBatch, loss_type: str) -> TrainingBatch:
    """`batch` with `loss_type`'s loss weights (Dr. GRPO's constant: the longest completion)."""
    lengths = torch.tensor(batch.completion_lengths)
    return dataclasses.replace(batch, weights=sequence_weights(loss_type, lengths, int(lengths.max())))


@pytest.fixture
def rollout():
    return synthetic_rollout()
