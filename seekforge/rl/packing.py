"""Dynamic packing of rollout sequences (prompt + completion) for the training phase.

A GRPO batch mixes short and long completions; padding every sequence to the longest (TRL's layout)
spends most of a step's FLOPs on padding. Here sequences are packed into rows of at most
`max_pack_tokens` tokens and `max_pack_count` sequences, first-fit decreasing, and each row is one
forward (B = 1): no padding at all. Inside a row every sequence has its own positions from 0 and its
own segment id, and the model's `document_mask(segment_ids)` makes attention block-diagonal causal,
so each sequence's logits are those of its own unpacked forward (tests/rl/test_packing.py).
Sequences are never cut: one longer than max_pack_tokens gets a row of its own.

Shape legend: T tokens of a row, C completion tokens of a row (the tokens that are scored), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def empty_row() -> PackedRow:
    """A one-token row that scores nothing: its forward and backward run every collective a sharded
    model's real rows run (FSDP: one all-gather and reduce-scatter per group) and add nothing, so a rank
    with fewer rows keeps in step with the others."""
    nothing = torch.zeros(0, dtype=torch.long)
    return PackedRow(input_ids=torch.zeros(1, 1, dtype=torch.long), positions=torch.zeros(1, 1, dtype=torch.long),
                     segment_ids=torch.zeros(1, 1, dtype=torch.long), score_index=nothing, targets=nothing,
                     sequence_of_token=nothing, sequences=[])


def row_log_probs(model, row: PackedRow) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (log p of each scored token, its entropy), both (C,) fp32. Only the scored positions go through
    the final norm and the head: the prompt's logits are never needed."""
    device = model.embed_tokens.weight.device
    h, _, _ = model.hidden(row.input_ids.to(device), row.positions.to(device), row.segment_ids.to(device))
    h = h[0, row.score_index.to(device)]  # (C, H)
    logits = model.lm_head(model.norm(h))  # (C, V)
    return token_log_probs(logits, row.targets.to(device))
