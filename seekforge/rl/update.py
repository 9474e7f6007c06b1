"""The training phase of a GRPO iteration on one rank: score packed rows, build the loss from the
algorithm's pieces, and accumulate gradients.

Every rank holds its share of the rollout batch (whole groups, rl/balance.py) packed into rows; each
row is one forward + backward. The loss weights come from the batch's global totals (`BatchTotals`),
so the gradients summed over rows and ranks (rl/trainer.py sums them over ranks) are the whole
batch's gradient however it was split.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from seekforge.rl.algorithm import BatchTotals, policy_loss, token_weights
from seekforge.rl.packing import PackedRow, row_log_probs


@dataclass
class LossSettings:
    loss_type: str = "dapo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    beta: float = 0.0  # KL-to-reference coefficient; 0 skips the reference model entirely


@dataclass
class TrainingBatch:
    """One rank's sequences, in the order the rows index them."""

    completion_lengths: list[int]
    advantages: torch.Tensor  # (n,) per sequence
    old_logps: list[torch.Tensor] | None  # per sequence (len_i,); None: on-policy (ratio 1)
    ref_logps: list[torch.Tensor] | None  # per sequence (len_i,); None when beta = 0


@torch.no_grad()
def sequence_log_probs(model, rows: list[PackedRow], num_sequences: int) -> list[torch.Tensor]:
    """Per-sequence completion log-probs (no graph): the old policy's before the updates, or the
    reference model's. Computed on the same rows as the training forward, so they match it exactly."""
    out: list[torch.Tensor | None] = [None] * num_sequences
    for row in rows:
        logp, _ = row_log_probs(model, row)
        for i, piece in zip(row.sequences, _split_by_sequence(logp, row), strict=True):
            out[i] = piece.cpu()
    return out


def _split_by_sequence(values: torch.Tensor, row: PackedRow) -> list[torch.Tensor]:
    if not row.sequences:  # an empty row (rl/packing.empty_row)
        return []
    counts = torch.bincount(row.sequence_of_token, minlength=max(row.sequences) + 1)[row.sequences]
    return list(values.split(counts.tolist()))


def accumulate_gradients(model, rows: list[PackedRow], batch: TrainingBatch, totals: BatchTotals,
                         settings: LossSettings,
                         compute_weights: Callable[[bool], AbstractContextManager] = lambda first: nullcontext()
                         ) -> dict[str, float]:
    """Forward + backward of every row; gradients add up in .grad. → this rank's weighted sums
    {"loss", "clipped", "kl", "entropy"} (sum them over ranks for the batch's values). Each row's
    forward and backward run inside `compute_weights(first row?)` (train/master.MasterWeights.compute:
    bf16 copies of the fp32 masters, made on the first row, each row's bf16 gradients added in fp32)."""
    device = model.embed_tokens.weight.device
    lengths = torch.tensor(batch.completion_lengths)
    sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "entropy": 0.0}
    for n, row in enumerate(rows):
        owner = row.sequence_of_token
        weights = token_weights(settings.loss_type, lengths[owner], totals).to(device)
        old = torch.cat([batch.old_logps[i] for i in row.sequences]).to(device) if batch.old_logps else None
        ref = torch.cat([batch.ref_logps[i] for i in row.sequences]).to(device) if settings.beta else None
        with compute_weights(n == 0):
            logp, entropy = row_log_probs(model, row)  # (C,)
            loss, stats = policy_loss(logp, logp.detach() if old is None else old, batch.advantages[owner].to(device),
                                      weights, settings.clip_low, settings.clip_high, settings.beta, ref)
            loss.backward()
        sums["loss"] += loss.item()
        sums["clipped"] += stats["clipped"].item()
        sums["kl"] += stats["kl"].item() if "kl" in stats else 0.0
        sums["entropy"] += (entropy * weights).sum().item()
    return sums
