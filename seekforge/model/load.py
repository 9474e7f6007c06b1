"""One call from a name on the command line to a model and its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from seekforge.config import PRESETS, ModelConfig, preset
from seekforge.errors import UserError
from seekforge.model.hf import drop_absent_mtp, load_hf, shard_files, tensor_files
from seekforge.model.model import build_model
from seekforge.model.tokenizer import load_tokenizer


def load_model(name_or_path: str, dtype=torch.float32, device="cpu", flag: str = "--model", read_weights=load_hf):
    """A preset name (random weights, byte tokenizer) or an HF-format checkpoint directory; `flag` names the
    command-line option it came from, for the error. `read_weights(path, device=, dtype=)` builds the model from
    the directory: load_hf, or quant/load.read_weights for verbs that take quantized checkpoints too. The
    tokenizer is checked against the model either way."""
    if name_or_path in PRESETS:
        tokenizer = load_tokenizer("byte")
        return build_model(preset(name_or_path), device, dtype).eval(), tokenizer
    path = checkpoint_dir(name_or_path, flag)
    model = read_weights(path, device=device, dtype=dtype).eval()
    return model, checkpoint_tokenizer(path, model.cfg)


def checkpoint_dir(name_or_path: str, flag: str = "--model") -> Path:
    """The HF checkpoint directory `flag` names, or the error that says what the path is instead."""
    path = Path(name_or_path)
    if not path.is_dir():
        raise ValueError(f"{flag} {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor a checkpoint directory")
    if not (path / "config.json").exists():
        if (path / "hf" / "config.json").exists():
            raise UserError(f"{flag} {path} is a training run directory; its HF export is {path / 'hf'}")
        if (path / "checkpoints").is_dir() or (path / ".metadata").exists() or (path / "latest").exists():
            raise UserError(f"{flag} {path} holds training checkpoints (DCP), not an HF checkpoint; export one with "
                            f"`seekforge convert {path} OUT_DIR` and pass OUT_DIR")
    return path


def checkpoint_config(name_or_path: str, flag: str = "--model") -> ModelConfig:
    """The ModelConfig load_model would build, without reading a weight (serve's ranks each read only their
    shards): a preset's, or the checkpoint's config.json less the MTP layers its weights lack (as load_hf)."""
    if name_or_path in PRESETS:
        return preset(name_or_path)
    path = checkpoint_dir(name_or_path, flag)
    return drop_absent_mtp(ModelConfig.from_hf(path), tensor_files(shard_files(path)[0]))


def checkpoint_tokenizer(path: Path, cfg: ModelConfig):
    """The tokenizer saved with a checkpoint (tokenizer.json), else the byte tokenizer; checked against `cfg`."""
    has_hf_tokenizer = (path / "tokenizer.json").exists()
    tokenizer = load_tokenizer(path if has_hf_tokenizer else "byte")
    check_tokenizer_fits(tokenizer, cfg, path / "tokenizer.json" if has_hf_tokenizer else "byte",
                         path / "config.json")
    return tokenizer


def model_width(name_or_path: str) -> int | None:
    """The hidden size of a preset or an HF checkpoint directory, read before loading it (for the `auto`
    dtype: model/precision.resolve_dtype); None when it cannot be told."""
    if name_or_path in PRESETS:
        return preset(name_or_path).hidden_size
    try:
        return int(json.loads((Path(name_or_path) / "config.json").read_text())["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # load_model says what is wrong with it


def check_tokenizer_fits(tokenizer, cfg: ModelConfig, tokenizer_source, config_source) -> None:
    """A tokenizer with more ids than the model has embedding rows is the wrong tokenizer for it:
    say so up front instead of failing with an index error inside the embedding."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(f"tokenizer {tokenizer_source} has {tokenizer.vocab_size} tokens but the model "
                        f"({config_source}) has vocab_size={cfg.vocab_size}: ids >= {cfg.vocab_size} have no "
                        "embedding. Use the tokenizer the model was trained with (the tokenizer.json saved next "
                        "to its weights)")
