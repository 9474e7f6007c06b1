"""GRPO's update step on one rank: pack its share of the scored sequences into rows, score the rows
under the old policy and the reference (log-probs without a graph), then build the loss from the
algorithm's pieces and accumulate gradients row by row.

Every rank holds its share of the rollout batch (whole groups, rl/balance.py) packed into rows; each
row is one forward + backward. The loss weights come from the batch's global totals (`BatchTotals`),
so the gradients summed over rows and ranks (rl/collectives.py) are the whole batch's gradient however
it was split.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from seekforge.model.precision import onednn_size, uses_onednn
from seekforge.rl.algorithm import BatchTotals, policy_loss, token_weights
from seekforge.rl.collectives import max_over_ranks, my_groups
from seekforge.rl.packing import PackedRow, empty_row, pack_sequences, pad_row, row_log_probs


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


def pack_my_sequences(prompt_ids: list[list[int]], completions: list[list[int]], group_size: int,
                      max_pack_tokens: int, max_pack_count: int, compute_dtype: torch.dtype, device: torch.device,
                      sharded: bool) -> tuple[list[int], list[PackedRow]]:
    """The sequences this rank trains (whole groups, balanced by their actual tokens) packed into rows.
    → (their indices in the step's group-major list, the rows; a row's `sequences` index the former)."""
    G = group_size
    group_tokens = [sum(len(prompt_ids[g]) + len(c) for c in completions[g * G:(g + 1) * G])
                    for g in range(len(prompt_ids))]
    seqs = [g * G + j for g in my_groups(group_tokens) for j in range(G)]
    rows = pack_sequences([prompt_ids[i // G] for i in seqs], [completions[i] for i in seqs],
                          max_pack_tokens, max_pack_count)
    if uses_onednn(device, compute_dtype):  # row lengths from a small set: kernels built once
        rows = [pad_row(row, onednn_size(row.input_ids.shape[1])) for row in rows]
    if sharded:  # FSDP: every rank runs as many forwards (its collectives)
        rows += [empty_row()] * (max_over_ranks(len(rows)) - len(rows))
    return seqs, rows


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
