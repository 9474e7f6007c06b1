"""indexed.py: round trip, atomic writes, and a clear ValueError naming the file for every kind of
corruption or truncation."""

import struct

import numpy as np
import pytest

from seekforge.data.indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype


def _write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype=dtype) as builder:
        for doc in docs:
            builder.add_document(doc)
        builder.finalize()


DOCS = [[1, 2, 3], [], [4], list(range(100, 150))]


def test_round_trip(tmp_path):
    _write(tmp_path / "d", DOCS)
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == 4 and ds.num_tokens == 54
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds.get(3, offset=10, length=5).tolist() == list(range(110, 115))


def test_optimal_dtype_threshold():
    assert optimal_dtype(259) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(129280) == np.int32


def test_token_outside_dtype_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="outside uint16"), IndexedDatasetBuilder(tmp_path / "d", np.uint16) as b:
        b.add_document([70000])
    assert list(tmp_path.iterdir()) == []  # the interrupted build left no temporaries, no final files


def test_files_appear_only_on_finalize(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "d", np.uint16)
    builder.add_document([1, 2])
    assert not (tmp_path / "d.bin").exists() and not (tmp_path / "d.idx").exists()
    builder.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def _corrupt(path, offset=None, data=None, truncate=None):
    raw = bytearray(path.read_bytes())
    if truncate is not None:
        raw = raw[:truncate]
    if data is not None:
        raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("file, change, message", [
    ("d.idx", dict(offset=0, data=b"NOTANIDX!"), "bad magic"),
    ("d.idx", dict(offset=9, data=struct.pack("<Q", 2)), "index version 2"),
    ("d.idx", dict(offset=17, data=b"\x63"), "unknown dtype code 99"),
    ("d.idx", dict(truncate=20), "shorter than the 34-byte header"),
    ("d.idx", dict(truncate=60), "truncated or corrupt"),
    ("d.idx", dict(offset=18, data=struct.pack("<Q", 5)), "needs"),  # sequence count ≠ arrays
    ("d.idx", dict(offset=34, data=struct.pack("<i", 4)), "pointers do not match"),  # size 3 → 4
    ("d.bin", dict(truncate=10), "truncated or mismatched"),
])
def test_corruption_names_the_file(tmp_path, file, change, message):
    _write(tmp_path / "d", DOCS)
    _corrupt(tmp_path / file, **change)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(tmp_path / "d")
    assert str(tmp_path / file) in str(info.value)


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="d.idx does not exist"):
        IndexedDataset(tmp_path / "d")
