"""Train/valid/test splits by document (Megatron's --split): the ranges are Megatron's, held-out
samples never hold a training document (checked token by token over every sample), built-in corpora
and blends are split the same way, and a split that leaves a needed split empty says how to fix it."""

import numpy as np
import pytest

from seekforge.config import TrainConfig, parse_split
from seekforge.data.dataset import BlendedDataset, GPTDataset, build_datasets, split_document_ranges
from seekforge.data.indexed import IndexedDatasetBuilder
from seekforge.model.tokenizer import ByteTokenizer

# (split, documents) → Megatron's [train, valid, test] ranges, printed by megatron-core 0.16's
# BlendedMegatronDatasetBuilder (tests/data/test_megatron_compat.py checks many more against the
# builder itself when megatron-core is importable). Empty ranges: Megatron builds an empty split or,
# for weight 0, none.
MEGATRON_RANGES = {
    ("969,30,1", 10): [(0, 10), (10, 10), (10, 10)],
    ("969,30,1", 50): [(0, 48), (48, 50), (50, 50)],
    ("969,30,1", 1000): [(0, 969), (969, 999), (999, 1000)],
    ("969,30,1", 1000003): [(0, 969003), (969003, 999003), (999003, 1000003)],
    ("8,1,1", 10): [(0, 8), (8, 9), (9, 10)],
    ("8,1,1", 1000003): [(0, 800002), (800002, 900003), (900003, 1000003)],
    ("1,1,1", 10): [(0, 3), (3, 7), (7, 10)],
    ("1,1,2", 10): [(0, 2), (2, 5), (5, 10)],  # 2.5 rounds half to even, as Python's round
    ("90,0,10", 10): [(0, 9), (9, 9), (9, 10)],
    ("99,1", 1000003): [(0, 990003), (990003, 1000003), (1000003, 1000003)],
    ("0.7,0.2,0.1", 1000003): [(0, 700002), (700002, 900003), (900003, 1000003)],
}


def _write_unique_documents(prefix, num_documents: int, first_id: int = 0, seed: int = 0) -> list[int]:
    """A .bin/.idx whose document d holds tokens first_id + 1000·d + j, so every token says which
    document it came from. Returns the document lengths."""
    lengths = np.random.default_rng(seed).integers(1, 30, size=num_documents).tolist()
    with IndexedDatasetBuilder(prefix, dtype=np.int32) as builder:
        for d, n in enumerate(lengths):
            builder.add_document(first_id + 1000 * d + np.arange(n))
        builder.finalize()
    return lengths


def _documents_in(dataset, first_id: int = 0) -> set[int]:
    """Every document any sample of `dataset` (all of them, inputs and labels) has a token from."""
    seen = set()
    for k in range(len(dataset)):
        sample = dataset[k]
        tokens = np.append(sample["input_ids"], sample["labels"][-1]) - first_id
        seen.update((tokens // 1000).tolist())
    return seen


@pytest.mark.parametrize(("split", "num_documents"), list(MEGATRON_RANGES))
def test_split_ranges_equal_megatrons(split, num_documents):
    ranges = split_document_ranges(split, num_documents)
    assert [(r.start, r.stop) for r in ranges] == MEGATRON_RANGES[split, num_documents]


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.03, 0.001), abs=1e-15)
    assert parse_split("99, 1") == pytest.approx((0.99, 0.01, 0.0), abs=1e-15)
    assert parse_split("100") == (1.0, 0.0, 0.0)
    for bad in ["", "a,b", "1,2,3,4", "-1,1,1", "0,0,0", "nan,1", 100]:
        with pytest.raises(ValueError, match="e.g. '969,30,1'"):
            parse_split(bad)


def test_train_config_split():
    assert TrainConfig().split == "969,30,1"
    with pytest.raises(ValueError, match=r"TrainConfig.split='1,2,3,4': split '1,2,3,4' is not"):
        TrainConfig(split="1,2,3,4")
    with pytest.raises(ValueError, match=r"TrainConfig.split='100,0,0': the valid share is 0.*'969,30,1'"):
        TrainConfig(split="100,0,0")


def test_valid_and_test_never_see_a_training_document(tmp_path):
    prefix = str(tmp_path / "docs")
    lengths = _write_unique_documents(prefix, 60)
    # 300 / 40 / 40 samples of 8 tokens: several epochs of the 6-document valid and test ranges.
    train, valid, test = build_datasets(prefix, ByteTokenizer(), 8, 0, (300, 40, 40), "8,1,1")
    assert [type(ds) for ds in (train, valid, test)] == [GPTDataset] * 3
    assert valid.num_epochs > 1 and test.num_epochs > 1
    seen = [_documents_in(ds) for ds in (train, valid, test)]
    ranges = split_document_ranges("8,1,1", len(lengths))
    nonempty = [{d for d in r if lengths[d]} for r in ranges]
    assert seen == nonempty  # exactly its own range, all of it: disjoint splits, no document lost
    for ds, r in zip((train, valid, test), ranges, strict=True):
        assert set(ds.document_index.tolist()) == set(r)


def test_builtin_corpus_is_split_and_sized_for_every_split():
    tokenizer = ByteTokenizer()
    train, valid, test = build_datasets("builtin:arithmetic", tokenizer, 32, 0, (200, 20, 0), "969,30,1")
    assert test is None and train.documents is valid.documents  # one generated corpus, split by range
    num_documents = len(train.documents)
    train_range, valid_range, _ = split_document_ranges("969,30,1", num_documents)
    assert set(train.document_index.tolist()) == set(train_range)
    assert set(valid.document_index.tolist()) == set(valid_range)
    # The corpus grew until the 3% valid share holds the 20 held-out samples without repeating.
    assert valid.num_epochs == 1 and train.num_epochs == 1
    again = build_datasets("builtin:arithmetic", tokenizer, 32, 0, (200, 20, 0), "969,30,1")
    assert np.array_equal(valid[5]["input_ids"], again[1][5]["input_ids"])


def test_split_that_leaves_a_needed_split_empty_says_how_to_fix_it(tmp_path):
    prefix = str(tmp_path / "docs")
    _write_unique_documents(prefix, 10)
    tokenizer = ByteTokenizer()
    # 969,30,1 of 10 documents: round(9.69) = round(9.99) = 10, so valid and test are empty...
    with pytest.raises(ValueError, match=r"split '969,30,1' gives the valid split documents \[10, 10\) of the 10 "
                                         r".*give valid a larger weight \(e.g. split='8,1,1'\)"):
        build_datasets(prefix, tokenizer, 8, 0, (10, 2, 0), "969,30,1")
    with pytest.raises(ValueError, match=r"split '100,0,0' gives the valid split"):
        build_datasets(prefix, tokenizer, 8, 0, (10, 2, 0), "100,0,0")
    with pytest.raises(ValueError, match=r"split '0,1,0' gives the train split"):
        build_datasets("builtin:text", tokenizer, 8, 0, (10, 2, 0), "0,1,0")
    # ...which is fine while nobody asks for them.
    train, valid, test = build_datasets(prefix, tokenizer, 8, 0, (10, 0, 0), "969,30,1")
    assert len(train) >= 10 and valid is None and test is None


def test_blend_is_split_per_dataset_then_blended(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    lengths_a = _write_unique_documents(a, 40, seed=1)
    lengths_b = _write_unique_documents(b, 25, first_id=10**6, seed=2)
    train, valid, _ = build_datasets(f"0.6 {a} 0.4 {b}", ByteTokenizer(), 8, 0, (200, 50, 0), "8,2,0")
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    assert len(valid) == 50 and np.bincount(valid.dataset_index).tolist() == [30, 20]
    for source, lengths, first_id in [(0, lengths_a, 0), (1, lengths_b, 10**6)]:
        ranges = split_document_ranges("8,2,0", len(lengths))[:2]  # no test split
        for blend, r in zip((train, valid), ranges, strict=True):
            seen = set()
            for n in np.flatnonzero(blend.dataset_index == source):  # every sample this source gave
                tokens = np.append(blend[n]["input_ids"], blend[n]["labels"][-1]) - first_id
                assert (tokens >= 0).all() and (tokens < 10**6).all()  # from this source
                seen.update((tokens // 1000).tolist())
            assert seen <= set(r)
        assert set(train.datasets[source].document_index.tolist()).isdisjoint(
            valid.datasets[source].document_index.tolist())
