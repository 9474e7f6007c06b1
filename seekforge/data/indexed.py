"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), byte-compatible in both directions.

`.bin` is every document's tokens back to back in one dtype. `.idx` (all little-endian):

    offset  field
    0       magic            b"MMIDIDX\\x00\\x00"          9 bytes
    9       version          <Q, always 1
    17      dtype code       <B (DTYPE_CODES below; 8 = uint16, 4 = int32)
    18      sequence count   <Q  S
    26      document count   <Q  D  (= number of documents + 1: document_indices starts with 0)
    34      sizes            int32[S]  tokens per sequence
            pointers         int64[S]  byte offset of each sequence in .bin
            document_indices int64[D]  sequence index where each document starts, then S

Megatron's `tools/preprocess_data.py` writes one sequence per document (sentence splitting off),
so here "document i" is sequence i, as in Megatron's GPTDataset. Both files are read through
numpy memmaps: opening a multi-GB corpus costs nothing until windows are read.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# Megatron's DType enum (megatron/core/datasets/indexed_dataset.py); the codes are the file format.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> type[np.integer]:
    """uint16 when every id fits with margin (vocab_size < 65500, Megatron's threshold), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def index_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDataset:
    """Read-only view of `PREFIX.bin/.idx`. `ds[i]` → np.ndarray (n_i,) of document i's tokens.

    Every structural fact is checked on open (magic, version, dtype code, array sizes against the
    .idx length, pointers against sizes, .bin length against the last pointer), so a truncated or
    foreign file fails here with its name rather than as garbage tokens mid-training.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        idx_file, bin_file = index_path(prefix), data_path(prefix)
        for f in (idx_file, bin_file):
            if not f.exists():
                raise ValueError(f"{f} does not exist; pass the prefix of a .bin/.idx pair "
                                 "(e.g. out_text_document for out_text_document.bin/.idx)")
        self._index = np.memmap(idx_file, dtype=np.uint8, mode="r") if idx_file.stat().st_size else b""
        self.dtype, num_sequences, num_document_indices = _read_header(idx_file, bytes(self._index[:HEADER_BYTES]))
        expected = HEADER_BYTES + (4 + 8) * num_sequences + 8 * num_document_indices
        if len(self._index) != expected:
            extra = " (a multimodal index with sequence modes? only text indexes are supported)" \
                if len(self._index) == expected + num_sequences else ""
            raise ValueError(f"{idx_file}: file is {len(self._index)} bytes but its header "
                             f"({num_sequences} sequences, {num_document_indices} document indices) "
                             f"needs {expected}{extra}; the file is truncated or corrupt — regenerate it "
                             "with `seekforge preprocess`")
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._index, np.int32, num_sequences, offset)  # (S,)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(self._index, np.int64, num_sequences, offset)  # (S,) bytes
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(self._index, np.int64, num_document_indices, offset)  # (D,)
        self._check_index(idx_file)

        itemsize = np.dtype(self.dtype).itemsize
        num_bytes = int(self.sequence_pointers[-1] + itemsize * self.sequence_lengths[-1]) if num_sequences else 0
        actual = bin_file.stat().st_size
        if actual != num_bytes:
            raise ValueError(f"{bin_file}: file is {actual} bytes but {idx_file.name} describes {num_bytes} "
                             f"({self.num_tokens} tokens of {np.dtype(self.dtype).name}); the pair is "
                             "truncated or mismatched — regenerate both with `seekforge preprocess`")
        # np.memmap refuses empty files; an empty dataset is still a valid dataset.
        self._tokens = np.memmap(bin_file, dtype=self.dtype, mode="r") if actual else np.empty(0, self.dtype)

    def _check_index(self, idx_file: Path) -> None:
        sizes, pointers, doc_idx = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = np.dtype(self.dtype).itemsize
        consistent = not len(sizes) or pointers[0] == 0
        # In chunks, so checking a corpus of 10^8 documents never materializes 10^8-long temporaries.
        for start in range(0, len(sizes), 1 << 20):
            stop = min(start + (1 << 20) + 1, len(sizes))
            chunk_sizes = sizes[start:stop].astype(np.int64)
            consistent &= chunk_sizes.min() >= 0 and bool(
                np.all(np.diff(pointers[start:stop]) == itemsize * chunk_sizes[:-1]))
        if not consistent:
            raise ValueError(f"{idx_file}: sequence pointers do not match sequence sizes; the index is "
                             "corrupt — regenerate it with `seekforge preprocess`")
        if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != len(sizes) or np.any(np.diff(doc_idx) < 0):
            raise ValueError(f"{idx_file}: document indices must rise from 0 to the sequence count "
                             f"{len(sizes)}; the index is corrupt — regenerate it with `seekforge preprocess`")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document i, (length,) in the file's dtype (no copy)."""
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        assert 0 <= offset and offset + length <= size, (i, offset, length, size)
        start = int(self.sequence_pointers[i]) // np.dtype(self.dtype).itemsize + offset
        return self._tokens[start:start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


def _read_header(idx_file: Path, header: bytes) -> tuple[type, int, int]:
    if len(header) < HEADER_BYTES:
        raise ValueError(f"{idx_file}: {len(header)} bytes is shorter than the {HEADER_BYTES}-byte header of a "
                         "Megatron .idx; the file is truncated — regenerate it with `seekforge preprocess`")
    if header[:9] != INDEX_MAGIC:
        raise ValueError(f"{idx_file}: bad magic {header[:9]!r}, expected {INDEX_MAGIC!r}; this is not a "
                         "Megatron indexed-dataset .idx (the older MMapIndexedDataset/lazy formats are not read)")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_file}: index version {version}, expected {INDEX_VERSION}")
    code = header[17]
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_file}: unknown dtype code {code}; expected one of {sorted(DTYPE_CODES)}")
    num_sequences, num_document_indices = struct.unpack("<QQ", header[18:34])
    return DTYPE_CODES[code], num_sequences, num_document_indices


class IndexedDatasetBuilder:
    """Write `PREFIX.bin/.idx` one document at a time: add_document(tokens) ..., then finalize().

    Both files are written under temporary names and renamed into place by finalize() (.bin first,
    then .idx), so a crash never leaves a complete-looking pair with missing tokens. Use as a
    context manager to delete the temporaries when an exception interrupts the build.
    """

    def __init__(self, prefix: str | Path, dtype: type[np.integer] = np.int32):
        if np.dtype(dtype) not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {dtype} has no Megatron code; use optimal_dtype(vocab_size)")
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp{os.getpid()}"
        self._tmp_bin = Path(f"{data_path(prefix)}{suffix}")
        self._tmp_idx = Path(f"{index_path(prefix)}{suffix}")
        self._bin = open(self._tmp_bin, "wb")
        self.sequence_lengths: list[int] = []
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._min_id, self._max_id = int(info.min), int(info.max)
        else:
            self._min_id, self._max_id = -np.inf, np.inf

    def add_document(self, tokens) -> None:
        """tokens: a sequence of ids (list, np.ndarray or 1-D tensor) → one document of len(tokens)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {array.shape}")
        if array.size and (array.min() < self._min_id or array.max() > self._max_id):
            raise ValueError(f"token ids span [{array.min()}, {array.max()}], outside {self.dtype.name}; "
                             "build with dtype=optimal_dtype(tokenizer.vocab_size) or np.int32")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    @property
    def num_tokens(self) -> int:
        return sum(self.sequence_lengths)

    def finalize(self) -> tuple[Path, Path]:
        """Write the index and move both files into place. Returns (bin_path, idx_path)."""
        self._bin.close()
        sizes = np.asarray(self.sequence_lengths, dtype=np.int32)  # (S,)
        pointers = np.zeros(len(sizes), dtype=np.int64)  # (S,) byte offsets
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.arange(len(sizes) + 1, dtype=np.int64)  # one sequence per document
        with open(self._tmp_idx, "wb") as f:
            f.write(INDEX_MAGIC)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<QQ", len(sizes), len(document_indices)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(document_indices.tobytes(order="C"))
        os.replace(self._tmp_bin, data_path(self.prefix))
        os.replace(self._tmp_idx, index_path(self.prefix))
        return data_path(self.prefix), index_path(self.prefix)

    def abort(self) -> None:
        """Close and delete the temporaries; the final names are untouched."""
        self._bin.close()
        for f in (self._tmp_bin, self._tmp_idx):
            f.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
