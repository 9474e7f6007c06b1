"""`--model` for every verb that may get a quantized checkpoint (serve, eval): model/load.load_model, whose
checks (the directory, the tokenizer against the model) apply to both, with a weights reader that swaps the
quantized linears in for a compressed-tensors directory."""

from __future__ import annotations

from pathlib import Path

import torch

from seekforge.model import load
from seekforge.model.hf import load_hf
from seekforge.quant.checkpoint import is_compressed, load_compressed


def read_weights(path: Path, device="cpu", dtype=torch.float32):
    """A compressed-tensors directory with QuantLinear / QuantExperts in place; any other as load_hf reads it."""
    if is_compressed(path):
        return load_compressed(path, dtype, device)
    return load_hf(path, device=device, dtype=dtype)


def load_model(name_or_path: str, dtype=torch.float32, device="cpu", flag: str = "--model"):
    """→ (model in eval mode, tokenizer), like model.load.load_model, quantized checkpoints too."""
    return load.load_model(name_or_path, dtype, device, flag, read_weights)
