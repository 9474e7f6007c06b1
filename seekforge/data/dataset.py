"""Training samples: fixed windows over a shuffled stream of documents (Megatron's GPTDataset idea),
weighted blends of several such datasets (Megatron's BlendedDataset), train/valid/test splits by
document range (Megatron's --split), and a resumable batch loader.

Shape legend: T = seq_len; every window holds T + 1 consecutive tokens w, giving
input_ids = w[:-1] and labels = w[1:], both (T,) int64; a batch stacks B of them → (B, T).

How a GPTDataset lays out samples (same sample boundaries as Megatron's `build_sample_idx`):
  1. epochs: as many passes over the documents as `num_samples * T + 1` tokens need;
  2. document order: every epoch is its own seeded permutation of the documents (of one split's
     document range, see `build_datasets`), concatenated into one virtual token stream (so each
     epoch sees each document once before any repeats; Megatron instead shuffles all epochs together);
  3. sample k covers stream tokens [k·T, k·T + T + 1): windows run across document boundaries and
     overlap by the one token that is the last label of k and the first input of k + 1;
  4. sample order: a seeded permutation of all windows in the stream.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from seekforge.config import parse_split
from seekforge.data.corpora import BUILTIN_CORPORA
from seekforge.data.indexed import IndexedDataset, optimal_dtype
from seekforge.model.loss import IGNORE_INDEX


class TokenDocuments:
    """Documents held in memory, read like an IndexedDataset (sequence_lengths, get) — the built-in
    corpora use it so a pretrain run starts without writing files."""

    def __init__(self, documents: list[list[int]] | list[np.ndarray], dtype=np.int32):
        self.sequence_lengths = np.array([len(d) for d in documents], dtype=np.int32)  # (D,)
        self._starts = np.zeros(len(documents) + 1, dtype=np.int64)  # (D + 1,) offsets into _tokens
        np.cumsum(self.sequence_lengths, out=self._starts[1:])
        self._tokens = np.fromiter(itertools.chain.from_iterable(documents), dtype=dtype,
                                   count=int(self._starts[-1]))  # (total tokens,)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self._starts[-1])

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self._starts[i]) + offset
        end = int(self._starts[i + 1]) if length is None else start + length
        return self._tokens[start:end]


class GPTDataset:
    """`ds[k]` → {"input_ids": (T,), "labels": (T,)} int64 arrays, plus "positions" and "segment_ids"
    (T,) when reset_per_document is set.

    reset_per_document (Megatron's reset_position_ids + reset_attention_mask): positions restart at
    0 where each document starts, segment_ids number the documents inside the window (for a
    block-diagonal causal mask), and a label that would cross into the next document is
    IGNORE_INDEX. Boundaries come from the document index itself, not from scanning for EOD, so
    they are right even for data preprocessed without EOD tokens.
    """

    def __init__(self, documents, seq_len: int, num_samples: int, seed: int, reset_per_document: bool = False,
                 document_ids: np.ndarray | None = None):
        """document_ids: the documents this dataset draws from (Megatron's indexed_indices: one split's
        document range); default all of them."""
        if seq_len < 1 or num_samples < 1:
            raise ValueError(f"seq_len={seq_len}, num_samples={num_samples}; both must be ≥ 1")
        sizes = np.asarray(documents.sequence_lengths, dtype=np.int64)  # (D,) over all documents
        if document_ids is None:
            document_ids = np.arange(len(sizes))
        tokens_per_epoch = int(sizes[document_ids].sum())
        if tokens_per_epoch < 2:
            raise ValueError(f"the dataset holds {tokens_per_epoch} tokens; a sample needs at least 2 "
                             "(input + label) — check the data prefix or corpus")
        self.documents, self.seq_len, self.reset_per_document = documents, seq_len, reset_per_document
        self.num_epochs = max(1, math.ceil((num_samples * seq_len + 1) / tokens_per_epoch))
        self.tokens_per_epoch = tokens_per_epoch
        rng = np.random.default_rng(seed)
        self.document_index = np.concatenate(  # (E·D',) document id at each position of the stream
            [rng.permutation(document_ids) for _ in range(self.num_epochs)])
        self._doc_sizes = sizes[self.document_index]  # (E·D',)
        self._doc_ends = np.cumsum(self._doc_sizes)  # (E·D',) exclusive end of each document in the stream
        # Windows start every T tokens; the last one needs its T + 1-th token inside the stream.
        num_windows = (int(self._doc_ends[-1]) - 1) // seq_len
        assert num_windows >= num_samples, (num_windows, num_samples)
        self.shuffle_index = rng.permutation(num_windows)  # (num_windows,)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_index(self, windows: np.ndarray | None = None) -> np.ndarray:
        """(N, 2) int64 [position in document_index, token offset in that document] where each window
        (default: all, plus the end marker, as Megatron's sample_idx) starts."""
        if windows is None:
            windows = np.arange(len(self) + 1)
        starts = np.asarray(windows, dtype=np.int64) * self.seq_len  # (N,) stream positions
        position = np.searchsorted(self._doc_ends, starts, side="right")  # first doc ending after start
        offset = starts - (self._doc_ends[position] - self._doc_sizes[position])
        return np.stack([position, offset], axis=1)

    def window(self, k: int) -> tuple[np.ndarray, list[int]]:
        """Sample k's T + 1 tokens (int64) and the lengths of the document pieces they come from."""
        (position, offset), = self.sample_index(np.array([self.shuffle_index[k]]))
        pieces, remaining = [], self.seq_len + 1
        while remaining:
            doc = int(self.document_index[position])
            piece = self.documents.get(doc, int(offset), min(remaining, int(self._doc_sizes[position]) - offset))
            pieces.append(piece)
            remaining -= len(piece)
            position, offset = position + 1, 0
        return np.concatenate(pieces).astype(np.int64), [len(p) for p in pieces if len(p)]

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        tokens, piece_lengths = self.window(k)  # (T + 1,)
        sample = {"input_ids": tokens[:-1], "labels": tokens[1:].copy()}
        if self.reset_per_document:
            segments = np.repeat(np.arange(len(piece_lengths)), piece_lengths)  # (T + 1,)
            positions = np.concatenate([np.arange(n) for n in piece_lengths])  # (T + 1,)
            sample["labels"][segments[:-1] != segments[1:]] = IGNORE_INDEX
            sample["positions"], sample["segment_ids"] = positions[:-1], segments[:-1]
        return sample


def blend_indices(weights, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's `build_blending_indices`: sample n goes to the dataset furthest behind its share
    (max of weight·n − used), so every prefix of the blend matches the weights within one sample.
    → dataset_index (num_samples,) int16, dataset_sample_index (num_samples,) int64."""
    weights = [float(w) for w in weights]
    used = [0] * len(weights)
    dataset_index = np.empty(num_samples, dtype=np.int16)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    for n in range(num_samples):
        n_ = max(n, 1.0)
        errors = [w * n_ - u for w, u in zip(weights, used, strict=True)]
        i = errors.index(max(errors))  # ties → the lowest index, as in Megatron
        dataset_index[n], dataset_sample_index[n] = i, used[i]
        used[i] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """`ds[n]` → a sample of datasets[dataset_index[n]]; the choice is fixed by the weights alone."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        if len(datasets) != len(weights) or any(w <= 0 for w in weights):
            raise ValueError(f"weights {weights} for {len(datasets)} datasets; give one positive weight each")
        self.datasets = datasets
        self.weights = [w / sum(weights) for w in weights]
        self.dataset_index, self.dataset_sample_index = blend_indices(self.weights, num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for ds, count in zip(datasets, counts, strict=True):
            assert len(ds) >= count, f"a blended dataset has {len(ds)} samples, the blend takes {count}"

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, n: int) -> dict[str, np.ndarray]:
        return self.datasets[self.dataset_index[n]][int(self.dataset_sample_index[n])]


class BatchLoader:
    """Endless iterator of batches: dicts of LongTensors (B / dp_size, T) with the dataset's keys.

    Global batch b holds samples b·B … b·B + B − 1 of an endless stream that walks the dataset in a
    fresh seeded permutation each pass; data-parallel rank r of dp_size takes rows
    [r·B/dp, (r+1)·B/dp) of it, so the ranks together see exactly the single-device batch. The whole
    state is the global batch counter, identical on every rank, so a run resumes exactly under any
    number of data-parallel ranks.
    """

    def __init__(self, dataset, batch_size: int, seed: int = 0, dp_rank: int = 0, dp_size: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; must be ≥ 1")
        if batch_size % dp_size:
            raise ValueError(f"the global batch of {batch_size} samples does not split over {dp_size} data-parallel "
                             f"ranks; make micro_batch_size a multiple of {dp_size}")
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.batches_yielded = 0
        self._order_pass, self._order = -1, None

    def _sample_at(self, stream_position: int) -> dict[str, np.ndarray]:
        data_pass, k = divmod(stream_position, len(self.dataset))
        if data_pass != self._order_pass:
            self._order = np.random.default_rng([self.seed, data_pass]).permutation(len(self.dataset))
            self._order_pass = data_pass
        return self.dataset[int(self._order[k])]

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = self.batch_size // self.dp_size
        first = self.batches_yielded * self.batch_size + self.dp_rank * rows
        samples = [self._sample_at(first + j) for j in range(rows)]
        self.batches_yielded += 1
        return {key: torch.from_numpy(np.stack([s[key] for s in samples]).astype(np.int64)) for key in samples[0]}

    def state_dict(self) -> dict:
        return {"batches_yielded": self.batches_yielded, "batch_size": self.batch_size, "seed": self.seed,
                "dataset_len": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("batch_size", "seed", "dataset_len"):
            if state[key] != mine[key]:
                raise ValueError(f"checkpoint data state has {key}={state[key]} but this loader has {mine[key]}: the "
                                 "run being resumed was trained on other data or batches. For a new run on this data "
                                 "pass --name NAME (or --no-resume to start this one over); to resume it, pass its "
                                 "data spec, seq_len, micro batch size and seed")
        self.batches_yielded = int(state["batches_yielded"])


# ---------------------------------------------------------------------------------------------
# Specs ("builtin:text", "PREFIX", "0.7 PREFIX_A 0.3 builtin:arithmetic") and train/valid/test splits
# ---------------------------------------------------------------------------------------------

MAX_BUILTIN_TOKENS = 8_000_000  # beyond this a built-in corpus repeats in epochs instead of growing


def parse_blend(spec: str) -> list[tuple[float, str]]:
    """"0.7 a 0.3 b" → [(0.7, "a"), (0.3, "b")]; a single "a" → [(1.0, "a")]. Weights unnormalized."""
    parts = spec.split()
    if len(parts) == 1:
        return [(1.0, parts[0])]
    if not parts or len(parts) % 2:
        raise ValueError(f"data spec {spec!r} is not 'PATH' or 'WEIGHT PATH WEIGHT PATH ...'; "
                         "e.g. '0.7 out_text_document 0.3 builtin:arithmetic'")
    blend = []
    for weight, path in zip(parts[::2], parts[1::2], strict=True):
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"data spec {spec!r}: {weight!r} is not a weight; write 'WEIGHT PATH' pairs") from None
        if w <= 0:
            raise ValueError(f"data spec {spec!r}: weight {w} for {path}; weights must be positive")
        blend.append((w, path))
    return blend


def builtin_documents(name: str, tokenizer, num_tokens: int, seed: int) -> TokenDocuments:
    """Generate and tokenize documents of a built-in corpus (each + EOS) until ≥ num_tokens tokens."""
    if name not in BUILTIN_CORPORA:
        raise ValueError(f"unknown built-in corpus builtin:{name}; choose from "
                         f"{', '.join('builtin:' + n for n in BUILTIN_CORPORA)}")
    texts, documents, total = BUILTIN_CORPORA[name](seed), [], 0
    target = min(num_tokens, MAX_BUILTIN_TOKENS)
    while total < target:
        chunk = [next(texts) for _ in range(1024)]
        for text in chunk:
            documents.append(tokenizer.encode(text) + [tokenizer.eos_token_id])
            total += len(documents[-1])
    return TokenDocuments(documents, dtype=optimal_dtype(tokenizer.vocab_size))


SPLITS = ("train", "valid", "test")


def split_document_ranges(split: str, num_documents: int) -> list[range]:
    """The train, valid and test document ranges of Megatron's --split, as megatron-core's
    BlendedMegatronDatasetBuilder cuts them: contiguous, in file order, each bound the cumulative
    share rounded to a document count, round(cumsum(shares) · D), in Megatron's float order so the
    ranges are equal to its own. A document is a sequence of the .idx (Megatron's GPT split). A split
    of weight 0 gets an empty range (Megatron builds none)."""
    bounds = itertools.accumulate(parse_split(split), initial=0.0)  # [0, s0, s0+s1, s0+s1+s2]
    ends = [int(round(bound * float(num_documents))) for bound in bounds]
    return [range(begin, end) for begin, end in itertools.pairwise(ends)]


def build_datasets(spec: str, tokenizer, seq_len: int, seed: int, num_samples: tuple[int, int, int],
                   split: str, reset_per_document: bool = False) -> list:
    """[train, valid, test] datasets (GPTDataset or BlendedDataset) with ≥ num_samples[i] samples of
    seq_len tokens each; None where num_samples[i] is 0.

    spec: "builtin:arithmetic", "builtin:text", a Megatron prefix (PREFIX.bin/.idx exist), or a blend
    "0.7 PREFIX_A 0.3 builtin:text". As Megatron with --split, every dataset of the spec is split by
    document (`split_document_ranges`) and each split gets its own sample index over its own range,
    so valid and test samples never hold a training document; a blend is split per dataset, then
    each split is blended with the spec's weights. A built-in corpus is generated from `seed` until
    every wanted split's share of it holds that split's tokens.
    """
    assert len(num_samples) == len(SPLITS), num_samples
    blend = parse_blend(spec)
    shares, total_weight = parse_split(split), sum(w for w, _ in blend)
    parts: list[list[GPTDataset]] = [[] for _ in SPLITS]  # per split, one dataset per blend entry
    for weight, path in blend:
        # Megatron's 0.5% margin so the blend never asks a dataset for more samples than it built.
        wanted = [n if len(blend) == 1 or n == 0 else math.ceil(n * weight / total_weight * 1.005) + 1
                  for n in num_samples]
        num_tokens = max(((n * seq_len + 1) / share for n, share in zip(wanted, shares, strict=True) if n and share),
                         default=0)
        documents = _documents(path, tokenizer, math.ceil(num_tokens), seed)
        sizes = np.asarray(documents.sequence_lengths, dtype=np.int64)  # (D,)
        for name, n, document_range, datasets in zip(SPLITS, wanted, split_document_ranges(split, len(sizes)),
                                                     parts, strict=True):
            if not n:
                continue
            num_split_tokens = int(sizes[document_range.start:document_range.stop].sum())
            if num_split_tokens < 2:
                raise ValueError(
                    f"split {split!r} gives the {name} split documents [{document_range.start}, "
                    f"{document_range.stop}) of the {len(sizes)} in {path}: {num_split_tokens} tokens, too few for "
                    f"one sample; give {name} a larger weight (e.g. split='8,1,1') or use more documents")
            datasets.append(GPTDataset(documents, seq_len, n, seed, reset_per_document,
                                       np.arange(document_range.start, document_range.stop)))
    return [None if not n else datasets[0] if len(blend) == 1
            else BlendedDataset(datasets, [w for w, _ in blend], n)
            for n, datasets in zip(num_samples, parts, strict=True)]


def _documents(path: str, tokenizer, num_tokens: int, seed: int):
    if path.startswith("builtin:"):
        return builtin_documents(path.removeprefix("builtin:"), tokenizer, num_tokens, seed)
    if path.endswith((".bin", ".idx")):  # a file of the pair was named; the prefix is meant
        path = path[:-4]
    return IndexedDataset(path)
