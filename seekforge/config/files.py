"""Reading config files: a YAML/TOML mapping (`read_config_file`), and the model any config names
(`model_config_of`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml

from seekforge.config.model import ModelConfig
from seekforge.config.train import TrainConfig


def read_config_file(path: str | Path, holds: str = "TrainConfig keys") -> dict[str, Any]:
    """A YAML or TOML config file (pretrain's, GRPO's, a quantization recipe, a probe config) → its mapping of
    `holds`; a clear error for anything else."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(text) or {}
        else:
            raise ValueError(f"config file {path}: use a .yaml, .yml or .toml extension")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"config file {path} does not parse: {' '.join(str(e).split())}") from e  # one line
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a mapping of {holds}")
    return raw


CONFIG_HELP = ("a config.json or a checkpoint directory holding one, a training run directory, or a pretrain config "
               "(YAML/TOML: its preset and model table)")


def model_config_of(source: str | Path) -> ModelConfig:
    """The model a config names, without reading a weight (`seekforge info`, `seekforge plan`): a config.json or a
    checkpoint directory holding one; a pretrain config (YAML/TOML: its preset and model table, as
    TrainConfig.model_config builds them); a training run directory (its HF export's config, else its
    train_config.yaml's model). A `--model` (a preset or an HF checkpoint) is model/load.checkpoint_config's."""
    path = Path(source)
    if path.suffix in (".yaml", ".yml", ".toml"):
        raw = read_config_file(path)
        return TrainConfig(preset=raw.get("preset", TrainConfig.preset), model=raw.get("model") or {}).model_config()
    if path.is_dir() and not (path / "config.json").exists():
        for inside in (path / "hf" / "config.json", path / "train_config.yaml"):
            if inside.exists():
                return model_config_of(inside)
    return ModelConfig.from_hf(path)
