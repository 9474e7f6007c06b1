"""seekforge's .bin/.idx is Megatron-LM's: each side reads what the other wrote, token for token, and
the sample/blend index builders match Megatron's C++ helpers exactly."""

import warnings

import numpy as np
import pytest

from seekforge.data.dataset import GPTDataset, TokenDocuments, blend_indices
from seekforge.data.indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype

with warnings.catch_warnings():  # megatron.core warns at import that Transformer Engine / Apex are absent
    warnings.simplefilter("ignore")
    megatron_indexed = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset",
        reason="megatron-core not importable; `pip install --no-deps megatron-core` to run the compatibility tests")


def _documents(vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Include a zero-length document and the largest id: both are edge cases of the format.
    docs = [rng.integers(0, vocab_size, size=n) for n in rng.integers(1, 50, size=30)]
    return [*docs[:5], np.array([], dtype=np.int64), np.array([vocab_size - 1]), *docs[5:]]


@pytest.mark.parametrize("vocab_size", [259, 100_000], ids=["uint16", "int32"])
def test_seekforge_reads_megatron(tmp_path, vocab_size):
    dtype = megatron_indexed.DType.optimal_dtype(vocab_size)
    assert dtype == optimal_dtype(vocab_size)
    prefix = str(tmp_path / "meg")
    builder = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    docs = _documents(vocab_size)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(prefix + ".idx")

    ours = IndexedDataset(prefix)
    assert ours.dtype == dtype and len(ours) == len(docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ours[i], doc)


@pytest.mark.parametrize("vocab_size", [259, 100_000], ids=["uint16", "int32"])
def test_megatron_reads_seekforge(tmp_path, vocab_size):
    prefix = str(tmp_path / "ours")
    docs = _documents(vocab_size, seed=1)
    with IndexedDatasetBuilder(prefix, dtype=optimal_dtype(vocab_size)) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()

    theirs = megatron_indexed.IndexedDataset(prefix)
    assert theirs.index.dtype == optimal_dtype(vocab_size) and len(theirs) == len(docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))


def test_same_bytes_as_megatron(tmp_path):
    docs = _documents(259, seed=2)
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(str(tmp_path / "meg.idx"))
    with IndexedDatasetBuilder(tmp_path / "ours", dtype=np.uint16) as ours:
        for doc in docs:
            ours.add_document(doc)
        ours.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"meg{suffix}").read_bytes()


def test_sample_index_matches_megatron_helper():
    from megatron.core.datasets import helpers_cpp

    rng = np.random.default_rng(0)
    docs = TokenDocuments([rng.integers(0, 100, size=n) for n in rng.integers(1, 40, size=25)])
    for seq_len, num_samples in [(8, 10), (16, 200), (7, 3)]:  # one epoch, many epochs, tiny
        ds = GPTDataset(docs, seq_len, num_samples, seed=3)
        theirs = helpers_cpp.build_sample_idx_int64(
            docs.sequence_lengths, ds.document_index.astype(np.int32), seq_len, ds.num_epochs,
            ds.tokens_per_epoch, True, 1)
        np.testing.assert_array_equal(ds.sample_index(), theirs)


def test_blend_indices_match_megatron_helper():
    from megatron.core.datasets import helpers_cpp

    weights = np.array([0.5, 0.3, 0.2])
    size = 1000
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(dataset_index, dataset_sample_index, weights, 3, size, False)
    ours = blend_indices(weights, size)
    np.testing.assert_array_equal(ours[0], dataset_index)
    np.testing.assert_array_equal(ours[1], dataset_sample_index)
