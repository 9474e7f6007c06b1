"""`--model` for every verb that may get a quantized checkpoint (serve, eval): a compressed-tensors
directory loads with its quantized linears swapped in; anything else goes to model.load."""

from __future__ import annotations

from pathlib import Path

import torch

from seekforge.model import load
from seekforge.model.tokenizer import load_tokenizer
from seekforge.quant.checkpoint import is_compressed, load_compressed


def load_model(name_or_path: str, dtype=torch.float32, device="cpu"):
    """→ (model in eval mode, tokenizer), like model.load.load_model."""
    path = Path(name_or_path)
    if not (path.is_dir() and is_compressed(path)):
        return load.load_model(name_or_path, dtype, device)
    model = load_compressed(path, dtype, device)
    return model, load_tokenizer(path if (path / "tokenizer.json").exists() else "byte")
