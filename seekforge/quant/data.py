"""Calibration samples: the built-in corpus's training split (by default) or a JSONL file of
{"text": ...} lines, tokenized and checked before any weight is touched."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from seekforge.config import TrainConfig
from seekforge.data.dataset import build_datasets

MIN_TOKENS = 2  # one next-token prediction


def calibration_samples(dataset: str, tokenizer, vocab_size: int, num_samples: int, max_seq_length: int,
                        seed: int = 0) -> list[torch.Tensor]:
    """→ num_samples token id tensors (T ≤ max_seq_length,). Raises ValueError for data that does not
    tokenize into ids this model has."""
    if dataset.startswith("builtin:"):
        train, _, _ = build_datasets(dataset, tokenizer, max_seq_length, seed, (num_samples, 0, 0),
                                     TrainConfig.split)
        samples = [torch.as_tensor(train[k]["input_ids"], dtype=torch.long) for k in range(num_samples)]
    else:
        samples = jsonl_samples(Path(dataset), tokenizer, num_samples, max_seq_length)
    for i, ids in enumerate(samples):
        if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise ValueError(f"calibration sample {i} of {dataset} has token id {int(ids.max())} outside the model's "
                             f"vocabulary of {vocab_size}: the tokenizer does not belong to this model; pass the "
                             "model's own tokenizer (tokenizer.json in the model directory)")
    return samples


def jsonl_samples(path: Path, tokenizer, num_samples: int, max_seq_length: int) -> list[torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"calibration dataset {path} is not a file; give a JSONL file of {{\"text\": ...}} lines "
                         "or builtin:text")
    samples = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{n} is not a JSON object with a \"text\" string; calibration data is "
                             "JSONL, one {\"text\": ...} per line") from None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{n}: \"text\" is {type(text).__name__}, not a string")
        ids = tokenizer.encode(text)[:max_seq_length]
        if len(ids) < MIN_TOKENS:
            raise ValueError(f"{path}:{n} tokenizes to {len(ids)} token(s); calibration needs at least "
                             f"{MIN_TOKENS} per sample: drop or lengthen it")
        samples.append(torch.tensor(ids, dtype=torch.long))
        if len(samples) == num_samples:
            break
    if not samples:
        raise ValueError(f"{path} holds no calibration text")
    return samples
