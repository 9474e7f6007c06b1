"""GRPO's score step: the rollout's completions → rewards → group advantages.

Each rank scores the completions it generated (the reward functions may be slow: user code, rl/rewards.py),
then every rank learns every group's completions and rewards (token ids: small), so advantages are
computed over whole groups and the training split can follow the actual sequence lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seekforge.rl.algorithm import group_advantages
from seekforge.rl.collectives import all_groups
from seekforge.rl.data import Sample
from seekforge.rl.rewards import RewardSet


@dataclass
class ScoredBatch:
    """The whole step's sequences, group-major: sequence g·G + j is completion j of prompt g."""

    completions: list[list[int]]  # token ids
    rewards: torch.Tensor  # (N,)
    advantages: torch.Tensor  # (N,)
    metrics: dict[str, float]  # each reward's mean, reward_errors, and the reward statistics below


def score_groups(rewards: RewardSet, tokenizer, samples: list[Sample], mine: list[int], local: list[list[int]],
                 group_size: int, scale_rewards: bool) -> ScoredBatch:
    """samples: the step's prompts; mine, local: this rank's prompt indices and their completions
    (rl/rollout.sample_groups). The rewards see each prompt's other columns (Sample.meta)."""
    G = group_size
    texts = [tokenizer.decode(c) for c in local]
    prompts_text = [samples[i].prompt for i in mine for _ in range(G)]
    metas = [samples[i].meta for i in mine for _ in range(G)]
    local_rewards, metrics = rewards.scores(prompts_text, texts, metas)
    completions, all_rewards, metrics = all_groups(mine, local, local_rewards, metrics, len(samples), G)
    by_group = all_rewards.view(-1, G)
    metrics.update(reward_mean=all_rewards.mean().item(), reward_std=all_rewards.std().item(),
                   zero_std_groups=(by_group.std(dim=1) == 0).float().mean().item())
    return ScoredBatch(completions, all_rewards, group_advantages(all_rewards, G, scale_rewards), metrics)
