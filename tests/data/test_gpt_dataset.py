"""dataset.py: windows cover the token stream, labels are inputs shifted by one, seeded order,
per-document positions/segments, blending proportions, exact BatchLoader resume, build_datasets specs."""

import numpy as np
import pytest
import torch

from seekforge.data.dataset import (
    BatchLoader,
    BlendedDataset,
    GPTDataset,
    TokenDocuments,
    build_datasets,
    parse_blend,
)
from seekforge.data.indexed import IndexedDatasetBuilder
from seekforge.model.loss import IGNORE_INDEX
from seekforge.model.tokenizer import ByteTokenizer


def _docs(seed=0, num_docs=20):
    """Documents whose tokens are globally unique (doc d holds 1000·d + j), so every token says
    where it came from."""
    rng = np.random.default_rng(seed)
    return TokenDocuments([1000 * d + np.arange(n) for d, n in enumerate(rng.integers(1, 30, size=num_docs))])


def _stream(ds):
    """The virtual token stream the dataset windows over: documents in document_index order."""
    return np.concatenate([ds.documents.get(int(d)) for d in ds.document_index])


def test_windows_cover_the_stream_and_labels_shift():
    docs = _docs()
    ds = GPTDataset(docs, seq_len=16, num_samples=50, seed=0)  # > 1 epoch of ~300 tokens
    assert ds.num_epochs > 1 and len(ds) >= 50
    stream = _stream(ds)
    covered = np.zeros(len(stream), dtype=bool)
    for k in range(len(ds)):
        sample = ds[k]
        np.testing.assert_array_equal(sample["input_ids"][1:], sample["labels"][:-1])
        start = ds.shuffle_index[k] * 16
        np.testing.assert_array_equal(sample["input_ids"], stream[start:start + 16])
        np.testing.assert_array_equal(sample["labels"], stream[start + 1:start + 17])
        covered[start:start + 17] = True
    assert covered[:len(ds) * 16 + 1].all()  # every token up to the last full window is used
    # Each epoch is a permutation of all documents.
    for epoch in np.split(ds.document_index, ds.num_epochs):
        assert sorted(epoch) == list(range(len(docs)))


def test_seeded_order():
    docs = _docs()
    a, b, c = (GPTDataset(docs, 8, 30, seed=s) for s in (0, 0, 1))
    first = [a[k]["input_ids"].tolist() for k in range(10)]
    assert first == [b[k]["input_ids"].tolist() for k in range(10)]
    assert first != [c[k]["input_ids"].tolist() for k in range(10)]


def test_reset_per_document():
    docs = _docs()
    ds = GPTDataset(docs, 32, 20, seed=0, reset_per_document=True)
    plain = GPTDataset(docs, 32, 20, seed=0)
    for k in range(len(ds)):
        s, p = ds[k], plain[k]
        np.testing.assert_array_equal(s["input_ids"], p["input_ids"])
        window = np.append(s["input_ids"], p["labels"][-1])
        doc_of = window // 1000  # the generating document of each token (unique tokens, see _docs)
        new_doc = np.r_[True, doc_of[1:] != doc_of[:-1]]
        # Adjacent docs in the stream can be the same document across an epoch boundary; then the
        # token value restarts at 1000·d, which also marks a new document.
        new_doc |= np.r_[True, window[1:] % 1000 == 0]
        np.testing.assert_array_equal(s["segment_ids"], np.cumsum(new_doc)[:-1] - 1)
        starts = np.flatnonzero(new_doc[:-1])
        expected_positions = np.arange(32) - starts[np.searchsorted(starts, np.arange(32), side="right") - 1]
        np.testing.assert_array_equal(s["positions"], expected_positions)
        crosses = new_doc[1:]
        np.testing.assert_array_equal(s["labels"][crosses], IGNORE_INDEX)
        np.testing.assert_array_equal(s["labels"][~crosses], p["labels"][~crosses])


def test_blend_proportions():
    a, b = _docs(0), TokenDocuments([[100_000 + i % 7] * 10 for i in range(40)])  # a's tokens < 20000
    weights, n = [0.7, 0.3], 1000
    datasets = [GPTDataset(a, 8, 710, 0), GPTDataset(b, 8, 310, 0)]
    blend = BlendedDataset(datasets, weights, n)
    from_b = sum(int(blend[i]["input_ids"][0] >= 100_000) for i in range(n))
    assert abs(from_b / n - 0.3) <= 0.002  # the greedy assignment is exact to within a sample
    for prefix in (10, 100, 333):  # and every prefix of the blend is balanced too
        assert abs(np.sum(blend.dataset_index[:prefix] == 1) - 0.3 * prefix) <= 1


def test_batch_loader_resume_is_exact():
    ds = GPTDataset(_docs(), 8, 20, seed=0, reset_per_document=True)
    uninterrupted = BatchLoader(ds, batch_size=3, seed=5)
    reference = [next(uninterrupted) for _ in range(20)]  # 60 samples: several passes over the data
    first = BatchLoader(ds, batch_size=3, seed=5)
    for _ in range(7):
        next(first)
    state = first.state_dict()
    resumed = BatchLoader(ds, batch_size=3, seed=5)
    resumed.load_state_dict(state)
    for expected in reference[7:]:
        got = next(resumed)
        assert got.keys() == expected.keys() == {"input_ids", "labels", "positions", "segment_ids"}
        for key in got:
            assert got[key].dtype == torch.long and got[key].shape == (3, 8)
            assert torch.equal(got[key], expected[key])
    other = BatchLoader(ds, batch_size=3, seed=6)
    assert not torch.equal(next(other)["input_ids"], reference[0]["input_ids"])
    with pytest.raises(ValueError, match="batch_size=3 but this loader has 4"):
        BatchLoader(ds, batch_size=4, seed=5).load_state_dict(state)


def test_batch_loader_data_parallel_slices_make_the_global_batch():
    ds = GPTDataset(_docs(), 8, 20, seed=0)
    single = BatchLoader(ds, batch_size=4, seed=5)
    reference = [next(single) for _ in range(6)]
    ranks = [BatchLoader(ds, batch_size=4, seed=5, dp_rank=r, dp_size=2) for r in range(2)]
    for rank in ranks:  # resume a 1-rank run's position on 2 ranks: the state is the global batch counter
        rank.load_state_dict({**single.state_dict(), "batches_yielded": 2})
    for expected in reference[2:]:
        halves = [next(rank) for rank in ranks]
        assert torch.equal(torch.cat([h["input_ids"] for h in halves]), expected["input_ids"])
    with pytest.raises(ValueError, match="make micro_batch_size a multiple of 3"):
        BatchLoader(ds, batch_size=4, seed=5, dp_rank=0, dp_size=3)


def test_parse_blend():
    assert parse_blend("a") == [(1.0, "a")]
    assert parse_blend("0.7 a 0.3 builtin:text") == [(0.7, "a"), (0.3, "builtin:text")]
    for bad in ["0.7 a 0.3", "x a 0.3 b", "-1 a 2 b"]:
        with pytest.raises(ValueError, match="data spec"):
            parse_blend(bad)


def test_build_dataset_specs(tmp_path):
    tokenizer = ByteTokenizer()

    def train_set(spec, seq_len, num_samples):
        return build_datasets(spec, tokenizer, seq_len, 0, (num_samples, 0, 0), "969,30,1")[0]

    text = train_set("builtin:text", 64, 40)
    assert len(text) >= 40 and text[0]["input_ids"].shape == (64,)
    assert (text.documents.get(0)[-1] == tokenizer.eos_token_id)  # every document ends in EOS
    again = train_set("builtin:text", 64, 40)
    assert np.array_equal(text[3]["labels"], again[3]["labels"])

    with IndexedDatasetBuilder(tmp_path / "d_text_document", np.uint16) as builder:
        for i in range(50):
            builder.add_document(tokenizer.encode(f"document number {i}.") + [tokenizer.eos_token_id])
        builder.finalize()
    prefix = str(tmp_path / "d_text_document")
    assert len(train_set(prefix, 16, 10)) >= 10
    assert len(train_set(prefix + ".bin", 16, 10)) >= 10
    blend = train_set(f"0.5 {prefix} 0.5 builtin:arithmetic", 16, 100)
    assert len(blend) == 100
    assert np.bincount(blend.dataset_index).tolist() == [50, 50]
    for i in range(0, 100, 7):
        source = blend.datasets[blend.dataset_index[i]]
        assert np.array_equal(blend[i]["input_ids"], source[blend.dataset_sample_index[i]]["input_ids"])
    assert b"Q: " in bytes(blend.datasets[1].documents.get(0)[:-1].astype(np.uint8))

    with pytest.raises(ValueError, match="builtin:arithmetic, builtin:text"):
        train_set("builtin:nope", 16, 10)
    with pytest.raises(ValueError, match="does not exist"):
        train_set(str(tmp_path / "missing"), 16, 10)
