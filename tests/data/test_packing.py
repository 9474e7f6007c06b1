"""packing.py: best-fit packing never cuts or loses a sequence, and packed logits equal the
logits of each sequence run alone (the reference path it replaces)."""

import numpy as np
import pytest
import torch

from seekforge.config import preset
from seekforge.data.packing import best_fit_bins, pack
from seekforge.model.loss import IGNORE_INDEX
from seekforge.model.model import Transformer


def test_best_fit_bins():
    lengths = [7, 3, 5, 2, 8, 1, 4]
    bins = best_fit_bins(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens in windows of 10: best fit is optimal here
    assert best_fit_bins(lengths, 10) == bins
    with pytest.raises(ValueError, match="sequence 0 has 7 tokens.*raise seq_len to ≥ 8"):
        best_fit_bins(lengths, 6)


def test_pack_layout():
    batch, bins = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=6, pad_token_id=0)
    assert bins == [[1, 2], [0]]  # 4 then 3 opened windows; 2 fit best next to the 4
    assert batch["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9], [1, 2, 3, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, -100, 7, 8, 9, -100], [2, 3, -100, -100, -100, -100]]
    assert batch["positions"].tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2]]
    assert batch["segment_ids"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]


def test_packed_logits_equal_separate():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    model.init_weights(seed=0)
    model.eval()
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 512, size=n).tolist() for n in (9, 5, 12, 3, 7)]
    batch, bins = pack(sequences, seq_len=16, pad_token_id=0)
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["positions"], batch["segment_ids"])  # (N, 16, V)
        for n, members in enumerate(bins):
            start = 0
            for i in members:
                alone = model(torch.tensor([sequences[i]]))[0]  # (len, V)
                torch.testing.assert_close(packed[n, start:start + len(sequences[i])], alone,
                                           rtol=1e-4, atol=1e-5)
                start += len(sequences[i])
    assert (batch["labels"] != IGNORE_INDEX).sum() == sum(len(s) - 1 for s in sequences)
