"""`seekforge preprocess`: tokenize a JSONL or text corpus into Megatron `.bin/.idx` files.

Worker processes tokenize chunks of lines (Pool.imap keeps the input order, so the output is the
same for any --workers); the parent alone writes, through IndexedDatasetBuilder, under temporary
names that are renamed into place at the end. Output follows Megatron's tools/preprocess_data.py:
PREFIX_{json_key}_document.bin/.idx, one sequence per document, uint16 when the vocabulary has
fewer than 65500 ids, else int32. Pass PREFIX_{json_key}_document to `seekforge pretrain --data`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from itertools import islice
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from seekforge.data.indexed import IndexedDatasetBuilder, optimal_dtype
from seekforge.errors import UserError
from seekforge.model.tokenizer import load_tokenizer

LINES_PER_CHUNK = 256  # large enough to amortize pickling, small enough for a smooth progress bar


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True,
                        help="corpus file: .jsonl (one JSON object per line, text under --json-key) or "
                             ".txt (one document per non-empty line)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a directory holding tokenizer.json")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX_{json-key}_document.bin and .idx (Megatron's naming); that "
                             "PREFIX_{json-key}_document is the path to train on")
    parser.add_argument("--json-key", default="text", help="the JSONL field holding each document's text")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="end every document with the tokenizer's EOS token (Megatron's --append-eod)")


def output_prefix(prefix: str, json_key: str) -> str:
    return f"{prefix}_{json_key}_document"


# Each worker loads the tokenizer once, in its initializer, rather than once per chunk.
_worker: dict = {}


def _init_worker(tokenizer_name: str, json_key: str, append_eod: bool, is_jsonl: bool, input_name: str) -> None:
    _worker.update(tokenizer=load_tokenizer(tokenizer_name), json_key=json_key, append_eod=append_eod,
                   is_jsonl=is_jsonl, input_name=input_name)


def _encode_chunk(chunk: tuple[int, list[str]]) -> list[list[int]]:
    """(first line number, lines) → token ids of each non-empty document in the chunk."""
    first_line, lines = chunk
    tokenizer, key = _worker["tokenizer"], _worker["json_key"]
    documents = []
    for line_number, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        text = _document_text(line, line_number, key) if _worker["is_jsonl"] else line.rstrip("\n")
        if not text:
            continue
        ids = tokenizer.encode(text)
        if _worker["append_eod"]:
            ids.append(tokenizer.eos_token_id)
        documents.append(ids)
    return documents


def _document_text(line: str, line_number: int, key: str) -> str:
    # UserError, not a bare ValueError: a worker's error reaches the CLI re-raised by the pool, and only
    # its type then says it is the user's file rather than a bug.
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{_worker['input_name']}:{line_number}: not valid JSON ({e.msg}); "
                        "a .jsonl file needs one JSON object per line") from None
    if not isinstance(record, dict) or key not in record:
        keys = list(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(f"{_worker['input_name']}:{line_number}: no {key!r} field (has {keys}); pass --json-key")
    text = record[key]
    if not isinstance(text, str):
        raise UserError(f"{_worker['input_name']}:{line_number}: the {key!r} field is a {type(text).__name__}, not "
                        "text; fix the line, or pass --json-key for the field that holds the document")
    return text


def _chunks(path: Path):
    with open(path, encoding="utf-8") as f:
        first_line = 1
        try:
            while lines := list(islice(f, LINES_PER_CHUNK)):
                yield first_line, lines
                first_line += len(lines)
        except UnicodeDecodeError:
            # UserError for the same reason as in _document_text: with --workers > 1 the pool re-raises it.
            raise UserError(_not_utf8(path)) from None


def _not_utf8(path: Path) -> str:
    """Where `path` first stops being UTF-8, as a message with the fix. The decoder's own error counts
    from its read buffer, so find the place again line by line (a newline byte never occurs inside a
    UTF-8 sequence, so decoding each line alone fails at the same byte)."""
    offset = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{path}:{line_number}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {offset + e.start}); "
                        f"re-encode the file, e.g. iconv -f latin1 -t utf-8 {path} > utf8{path.suffix}")
            offset += len(raw)
    return f"{path}: not UTF-8; re-encode the file, e.g. with iconv -t utf-8"


def preprocess(input_path: str | Path, tokenizer_name: str, prefix: str, json_key: str = "text",
               workers: int = 1, append_eod: bool = True, progress: bool = True) -> dict:
    """Tokenize input_path into `output_prefix(prefix, json_key)`.bin/.idx → summary dict."""
    input_path = Path(input_path)
    if not input_path.is_file():
        raise ValueError(f"--input {input_path} is not a file")
    if input_path.suffix not in (".jsonl", ".json", ".txt"):
        raise ValueError(f"--input {input_path}: expected a .jsonl or .txt file")
    if workers < 1:
        raise ValueError(f"--workers {workers}; pass at least 1")
    from tqdm import tqdm

    tokenizer = load_tokenizer(tokenizer_name)
    # Checked here, not in the workers: a Pool whose initializer raises respawns workers forever.
    if append_eod and tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer_name} has no EOS token; pass --no-append-eod")
    out = output_prefix(prefix, json_key)
    init_args = (tokenizer_name, json_key, append_eod, input_path.suffix != ".txt", str(input_path))
    start = time.perf_counter()
    num_documents = 0
    with contextlib.ExitStack() as stack:
        builder = stack.enter_context(IndexedDatasetBuilder(out, dtype=optimal_dtype(tokenizer.vocab_size)))
        bar = stack.enter_context(tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=not progress))
        if workers == 1:  # in-process: easier to debug, and no pickling for small inputs
            _init_worker(*init_args)
            results = map(_encode_chunk, _chunks(input_path))
        else:
            pool = stack.enter_context(Pool(workers, initializer=_init_worker, initargs=init_args))
            results = pool.imap(_encode_chunk, _chunks(input_path))
        for documents in results:
            for ids in documents:
                builder.add_document(np.asarray(ids))
            num_documents += len(documents)
            bar.update(sum(map(len, documents)))
            bar.set_postfix_str(f"{num_documents} docs", refresh=False)
        bin_file, idx_file = builder.finalize()
    if num_documents == 0:  # a dataset of nothing would fail later, at training time, less clearly
        for f in (bin_file, idx_file):
            Path(f).unlink(missing_ok=True)
        raise ValueError(f"--input {input_path} holds no documents (every line is empty"
                         f"{'' if input_path.suffix == '.txt' else ' or its text is'}); nothing was written")
    return {"documents": num_documents, "tokens": builder.num_tokens, "dtype": builder.dtype.name,
            "seconds": time.perf_counter() - start, "prefix": out, "files": [str(bin_file), str(idx_file)]}


def run(args) -> None:
    summary = preprocess(args.input, args.tokenizer, args.output_prefix, args.json_key, args.workers,
                         args.append_eod)
    tokens_per_s = summary["tokens"] / max(summary["seconds"], 1e-9)
    print(f"{summary['documents']} documents, {summary['tokens']} tokens ({summary['dtype']}) "
          f"in {summary['seconds']:.1f}s ({tokens_per_s:,.0f} tok/s)")
    for f in summary["files"]:
        print(f"  wrote {f}")
    print(f"train on it with --data {summary['prefix']}")
