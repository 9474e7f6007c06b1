"""Pack variable-length sequences (e.g. RL rollouts: prompt + completion) into fixed windows without
cutting any sequence, so a batch wastes few tokens on padding and no document sees another.

Best-fit decreasing: place sequences longest first, each into the open window with the least room
that still fits it (a new window when none does). Within a window every sequence gets its own
segment id and positions from 0, and the model's `document_mask(segment_ids)` keeps attention
inside each sequence — so packed logits equal per-sequence logits (tests/data/test_packing.py).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from seekforge.model.loss import IGNORE_INDEX


def best_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length ≤ capacity; bins keep input order
    inside, and the packing is deterministic (ties broken by index)."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sequence {i} has {n} tokens, more than the window of {capacity}; truncate it "
                         f"or raise seq_len to ≥ {max(n for _, n in too_long)}")
    free: list[tuple[int, int]] = []  # sorted (room left, bin id): bisect finds the tightest fit
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(slot)
            bins[b].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, b))
    return [sorted(b) for b in bins]


def pack(sequences: list[list[int]], seq_len: int, pad_token_id: int) -> tuple[dict[str, torch.Tensor], list]:
    """Pack token sequences into N windows of seq_len.

    → (batch, bins): batch holds LongTensors (N, T) input_ids, labels (next token within the same
    sequence, IGNORE_INDEX at each sequence's last token and on padding), positions (from 0 per
    sequence) and segment_ids (sequences numbered 0, 1, … per window; padding takes the next number,
    so it attends only to itself); bins[n] lists the sequence indices in window n, in order.
    """
    bins = best_fit_bins([len(s) for s in sequences], seq_len)
    shape = (len(bins), seq_len)
    input_ids = np.full(shape, pad_token_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(shape, dtype=np.int64)
    segment_ids = np.zeros(shape, dtype=np.int64)
    for n, members in enumerate(bins):
        start = 0
        for segment, i in enumerate(members):
            tokens = np.asarray(sequences[i], dtype=np.int64)
            end = start + len(tokens)
            input_ids[n, start:end] = tokens
            labels[n, start:end - 1] = tokens[1:]
            positions[n, start:end] = np.arange(len(tokens))
            segment_ids[n, start:end] = segment
            start = end
        segment_ids[n, start:] = len(members)
        positions[n, start:] = np.arange(seq_len - start)
    batch = {"input_ids": input_ids, "labels": labels, "positions": positions, "segment_ids": segment_ids}
    return {k: torch.from_numpy(v) for k, v in batch.items()}, bins
