"""seekforge's .bin/.idx is Megatron-LM's: each side reads what the other wrote, token for token, the
sample/blend index builders match Megatron's C++ helpers exactly, and --split cuts the same document
ranges as megatron-core's dataset builder."""

import warnings

import numpy as np
import pytest

from seekforge.data.dataset import GPTDataset, TokenDocuments, blend_indices, split_document_ranges
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
    split_range = np.arange(5, 20)  # a split's documents, as Megatron's indexed_indices
    for seq_len, num_samples, document_ids in [(8, 10, None), (16, 200, None), (7, 3, None), (8, 60, split_range)]:
        ds = GPTDataset(docs, seq_len, num_samples, seed=3, document_ids=document_ids)
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


def _megatron_split_ranges(split: str, num_documents: int) -> list:
    """The document ids megatron-core's BlendedMegatronDatasetBuilder gives each split of a dataset of
    num_documents sequences (None: a split it does not build), read from the indexed_indices it passes
    to the dataset class — here a stand-in that only records them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig

    class SplitRecorder:
        def __init__(self, low_level_dataset, path, indexed_indices, num_samples, index_split, config):
            self.indexed_indices = indexed_indices

        def __len__(self):
            return len(self.indexed_indices)

        @staticmethod
        def build_low_level_dataset(path, config):
            return None

        @staticmethod
        def numel_low_level_dataset(low_level_dataset):
            return num_documents

    config = BlendedMegatronDatasetConfig(random_seed=0, sequence_length=8, blend=(["docs"], None), split=split)
    built = BlendedMegatronDatasetBuilder(SplitRecorder, [None] * 3, lambda: True, config).build()
    return [None if ds is None else ds.indexed_indices.tolist() for ds in built]


@pytest.mark.parametrize("split", ["969,30,1", "99,1,0", "98,2", "8,1,1", "1,1,1", "1,1,2", "90,0,10", "100",
                                   "0.7,0.2,0.1", "33,33,34"])
def test_split_ranges_match_megatron_builder(split):
    for num_documents in [*range(1, 64), 99, 100, 1000, 12345, 1_000_003]:
        theirs = _megatron_split_ranges(split, num_documents)
        ours = split_document_ranges(split, num_documents)
        for mine, megatron in zip(ours, theirs, strict=True):
            assert list(mine) == (megatron if megatron is not None else []), (split, num_documents)
