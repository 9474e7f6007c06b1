"""GRPO's update step on one rank: pack its share of the scored sequences into rows, score the rows
under the old policy and the reference (log-probs without a graph), then build the loss from the
algorithm's pieces and accumulate gradients row by row.

Every rank holds its share of the rollout batch (whole groups, rl/balance.py) packed into rows; each
row is one forward + backward. The loss weights come from the whole batch (`algorithm.sequence_weights`,
carried per sequence in `TrainingBatch.weights`), so the gradients summed over rows and ranks
(rl/collectives.py) are the whole batch's gradient however it was split. Rows are units of compute only:
TRL's micro-batches (what bnpo normalizes by and top_entropy_quantile ranks within) are GRPOConfig's
`micro_batch_size` consecutive sequences, whatever rows they were packed into.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from seekforge.model.precision import onednn_size, uses_onednn
from seekforge.rl.algorithm import LossSettings, high_entropy_masks, policy_loss
from seekforge.rl.collectives import all_sequences, max_over_ranks, my_groups
from seekforge.rl.packing import PackedRow, empty_row, pack_sequences, pad_row, row_log_probs


@dataclass
class TrainingBatch:
    """One rank's sequences, in the order the rows index them."""

    completion_lengths: list[int]
    advantages: torch.Tensor  # (n,) per sequence
    old_logps: list[torch.Tensor] | None  # per sequence (len_i,); None: on-policy (ratio 1)
    ref_logps: list[torch.Tensor] | None  # per sequence (len_i,); None when beta = 0
    weights: torch.Tensor  # (n,) the loss weight of each of the sequence's tokens (algorithm.sequence_weights)
    token_share: torch.Tensor  # (n,) each token's weight in the logged token means (algorithm.token_share)

    def subset(self, indices: list[int]) -> TrainingBatch:
        """The batch of the sequences `indices` (a rank's share), weights as in the whole batch."""
        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return TrainingBatch([self.completion_lengths[i] for i in indices], self.advantages[indices],
                             pick(self.old_logps), pick(self.ref_logps), self.weights[indices],
                             self.token_share[indices])


def in_loss(completions: list[list[int]], stop_ids: set[int], mask_truncated_completions: bool) -> torch.Tensor:
    """Which sequences the loss sees (N,) bool: all, or with mask_truncated_completions (DAPO §3.4's overlong
    filtering) those that ended on a stop token (end-of-sequence or padding, as TRL tells them apart) rather
    than at max_new_tokens. A truncated completion's reward grades an unfinished answer; it still counts in
    its group's advantages."""
    if not mask_truncated_completions:
        return torch.ones(len(completions), dtype=torch.bool)
    return torch.tensor([bool(c) and c[-1] in stop_ids for c in completions], dtype=torch.bool)


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
def sequence_log_probs(model, rows: list[PackedRow], num_sequences: int, temperature: float = 1.0,
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sequence completion log-probs and entropies (no graph) at the sampling temperature: the old
    policy's before the updates, the reference model's, or the current policy's entropies. Computed on the
    same rows as the training forward, so they match it exactly."""
    logps: list[torch.Tensor | None] = [None] * num_sequences
    entropies: list[torch.Tensor | None] = [None] * num_sequences
    for row in rows:
        logp, entropy = row_log_probs(model, row, temperature)
        for i, piece, h in zip(row.sequences, _split_by_sequence(logp, row), _split_by_sequence(entropy, row),
                               strict=True):
            logps[i], entropies[i] = piece.cpu(), h.cpu()
    return logps, entropies


def _split_by_sequence(values: torch.Tensor, row: PackedRow) -> list[torch.Tensor]:
    if not row.sequences:  # an empty row (rl/packing.empty_row)
        return []
    counts = torch.bincount(row.sequence_of_token, minlength=max(row.sequences) + 1)[row.sequences]
    return list(values.split(counts.tolist()))


def entropy_masks(model, rows: list[PackedRow], seqs: list[int], scored: torch.Tensor, micro_batch_size: int,
                  quantile: float, temperature: float) -> list[torch.Tensor]:
    """top_entropy_quantile's per-token masks of this rank's sequences (`seqs`, indices into the step's
    batch; scored (N,) as `in_loss`). The threshold is a quantile over a whole micro-batch's tokens, known
    before any row's loss: one forward without a graph over the rows (at the current weights, the ones the
    training pass runs), the entropies gathered over ranks."""
    _, entropies = sequence_log_probs(model, rows, len(seqs), temperature)
    everyone = all_sequences(seqs, entropies, scored.numel())
    masks = high_entropy_masks(everyone, scored.tolist(), micro_batch_size, quantile)
    return [masks[i] for i in seqs]


def _row_values(per_sequence: list[torch.Tensor], row: PackedRow, device) -> torch.Tensor:
    if not row.sequences:
        return torch.zeros(0, device=device)
    return torch.cat([per_sequence[i] for i in row.sequences]).to(device)


def accumulate_gradients(model, rows: list[PackedRow], batch: TrainingBatch, settings: LossSettings,
                         compute_weights: Callable[[bool], AbstractContextManager] = lambda first: nullcontext(),
                         policy_masks: list[torch.Tensor] | None = None) -> dict[str, float]:
    """Forward + backward of every row; gradients add up in .grad. → this rank's shares {"loss", "clipped",
    "kl", "entropy"} (sum them over ranks for the batch's loss and token means). policy_masks: per sequence,
    top_entropy_quantile's tokens (`entropy_masks`). Each row's forward and backward run inside
    `compute_weights(first row?)` (train/master.MasterWeights.compute: bf16 copies of the fp32 masters, made
    on the first row, each row's bf16 gradients added in fp32)."""
    device = model.embed_tokens.weight.device
    num_sequences = len(batch.completion_lengths)
    sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "entropy": 0.0}
    for n, row in enumerate(rows):
        owner = row.sequence_of_token.to(device)
        weights, share = batch.weights.to(device)[owner], batch.token_share.to(device)[owner]
        old = _row_values(batch.old_logps, row, device) if batch.old_logps else None
        ref = _row_values(batch.ref_logps, row, device) if settings.beta else None
        mask = _row_values(policy_masks, row, device) if policy_masks is not None else None
        with compute_weights(n == 0):
            logp, entropy = row_log_probs(model, row, settings.temperature)  # (C,)
            loss, stats = policy_loss(logp, logp.detach() if old is None else old, batch.advantages.to(device)[owner],
                                      weights, settings, ref, owner, num_sequences, mask)
            loss.backward()
        sums["loss"] += loss.item()
        sums["clipped"] += (stats["clipped"] * share).sum().item()
        sums["kl"] += (stats["kl"] * share).sum().item() if "kl" in stats else 0.0
        sums["entropy"] += (entropy * share).sum().item()
    return sums
