"""Dynamic packing of rollout sequences (prompt + completion) for the training phase.

A GRPO batch mixes short and long completions; padding every sequence to the longest (TRL's layout)
spends most of a step's FLOPs on padding. Here sequences are packed into rows of at most
`max_pack_tokens` tokens and `max_pack_count` sequences, first-fit decreasing, and each row is one
forward (B = 1): no padding (bf16 on a CPU pads a row by ≤ 12.5%: `pad_row`). Inside a row every sequence
has its own positions from 0 and its own segment id, and the model's `document_mask(segment_ids)` makes
attention block-diagonal causal, so each sequence's logits are those of its own unpacked forward
(tests/rl/test_packing.py).
Sequences are never cut: one longer than max_pack_tokens gets a row of its own.

Shape legend: T tokens of a row, C completion tokens of a row (the tokens that are scored), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seekforge.model.precision import matmul_dtype, onednn_size, uses_onednn
from seekforge.rl.algorithm import token_log_probs


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # (1, T) the packed prompt+completion tokens
    positions: torch.Tensor  # (1, T) from 0 within each sequence
    segment_ids: torch.Tensor  # (1, T) 0, 1, … per sequence
    score_index: torch.Tensor  # (C,) row positions whose next token is a completion token
    targets: torch.Tensor  # (C,) those completion tokens
    sequence_of_token: torch.Tensor  # (C,) index (into the packed list) of each scored token's sequence
    sequences: list[int]  # the packed list's indices in this row, in order


def pack_bins(lengths: list[int], max_pack_tokens: int, max_pack_count: int) -> list[list[int]]:
    """First-fit decreasing under both limits: indices of `lengths` grouped into rows. Deterministic
    (ties by index); rows keep ascending indices inside."""
    if max_pack_tokens < 1 or max_pack_count < 1:
        raise ValueError(f"max_pack_tokens={max_pack_tokens}, max_pack_count={max_pack_count}: both must be >= 1")
    rows: list[list[int]] = []
    room: list[int] = []  # tokens left per row
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r in range(len(rows)):
            if lengths[i] <= room[r] and len(rows[r]) < max_pack_count:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_pack_tokens - lengths[i])  # negative for an over-long sequence: nothing joins it
    return [sorted(r) for r in rows]


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], max_pack_tokens: int,
                   max_pack_count: int) -> list[PackedRow]:
    """Rows of (prompt + completion) sequences. The scored tokens are the completion's: position p of
    a sequence predicts token p + 1, so a completion of n tokens after a prompt of m is scored at
    positions m − 1 … m + n − 2."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    rows = []
    for members in pack_bins(lengths, max_pack_tokens, max_pack_count):
        ids, positions, segments, score_index, targets, owner = [], [], [], [], [], []
        for segment, i in enumerate(members):
            start, prompt, completion = len(ids), prompts[i], completions[i]
            ids += prompt + completion
            positions += range(len(prompt) + len(completion))
            segments += [segment] * (len(prompt) + len(completion))
            score_index += range(start + len(prompt) - 1, start + len(prompt) + len(completion) - 1)
            targets += completion
            owner += [i] * len(completion)
        rows.append(PackedRow(
            input_ids=torch.tensor([ids]), positions=torch.tensor([positions]),
            segment_ids=torch.tensor([segments]), score_index=torch.tensor(score_index, dtype=torch.long),
            targets=torch.tensor(targets, dtype=torch.long), sequence_of_token=torch.tensor(owner, dtype=torch.long),
            sequences=members))
    return rows


def pad_row(row: PackedRow, length: int) -> PackedRow:
    """`row` with a padding document appended up to `length` tokens (token 0 at positions 0, 1, …, its
    own segment, nothing scored). Attention stays within documents and nothing reads the padding's
    outputs, so every scored token's log-prob and gradient are unchanged; the row's shape is `length`
    (the trainer rounds rows up to sizes whose kernels oneDNN has already built: precision.onednn_size)."""
    extra = length - row.input_ids.shape[1]
    if extra <= 0:
        return row
    segment = int(row.segment_ids[0, -1]) + 1
    return PackedRow(input_ids=torch.cat([row.input_ids, row.input_ids.new_zeros(1, extra)], dim=1),
                     positions=torch.cat([row.positions, torch.arange(extra)[None]], dim=1),
                     segment_ids=torch.cat([row.segment_ids, torch.full((1, extra), segment)], dim=1),
                     score_index=row.score_index, targets=row.targets, sequence_of_token=row.sequence_of_token,
                     sequences=row.sequences)


def empty_row() -> PackedRow:
    """A one-token row that scores nothing: its forward and backward run every collective a sharded
    model's real rows run (FSDP: one all-gather and reduce-scatter per group) and add nothing, so a rank
    with fewer rows keeps in step with the others."""
    nothing = torch.zeros(0, dtype=torch.long)
    return PackedRow(input_ids=torch.zeros(1, 1, dtype=torch.long), positions=torch.zeros(1, 1, dtype=torch.long),
                     segment_ids=torch.zeros(1, 1, dtype=torch.long), score_index=nothing, targets=nothing,
                     sequence_of_token=nothing, sequences=[])


def row_log_probs(model, row: PackedRow, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (log p of each scored token, its entropy), both (C,) fp32, at the sampling temperature
    (algorithm.token_log_probs). Only the scored positions go through the final norm and the head: the
    prompt's logits are never needed."""
    device = model.embed_tokens.weight.device
    h, _, _ = model.hidden(row.input_ids.to(device), row.positions.to(device), row.segment_ids.to(device))
    index = row.score_index.to(device)
    scored = len(index)
    if uses_onednn(device, matmul_dtype(model.lm_head.weight)):  # the head's rows: a size oneDNN has built for
        index = torch.cat([index, index.new_zeros(onednn_size(scored) - scored)])
    logits = model.lm_head(model.norm(h[0, index]))[:scored]  # (C, V)
    return token_log_probs(logits, row.targets.to(device), temperature=temperature)
