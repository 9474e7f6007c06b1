"""TrainConfig ⇄ YAML / TOML files, and `key=value` command-line overrides.

A file is a flat mapping onto the TrainConfig fields (plus a `model:` table of ModelConfig
overrides and a `parallel:` table of ParallelConfig keys). Unknown keys and wrongly typed values
raise ValueError naming the key, so a typo never silently trains the default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from seekforge.config import TrainConfig, read_config_file

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TABLES = ("model", "parallel")  # nested mappings; a file's table and the overrides' merge key by key


def load_train_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Defaults ← file (YAML or TOML, by extension) ← overrides ("key=value" strings or a dict)."""
    raw: dict[str, Any] = read_config_file(path) if path else {}
    if isinstance(overrides, dict):
        updates = dict(overrides)
    else:
        updates = parse_overrides(overrides or [])
    tables = {key: {**raw.get(key, {}), **updates.pop(key, {})} for key in _TABLES}
    raw.update(updates)
    raw.update({key: table for key, table in tables.items() if table})
    return train_config_from_dict(raw)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["lr=1e-3", "model.num_hidden_layers=2", "parallel.tp=2"] → {"lr": 0.001, "model":
    {"num_hidden_layers": 2}, "parallel": {"tp": 2}}. Values are parsed as YAML scalars/lists, so
    `betas=[0.9,0.99]` and `compile=true` work."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value (e.g. --set lr=1e-3)")
        key, text = item.split("=", 1)
        value = yaml.safe_load(text) if text else ""
        table, _, name = key.partition(".")
        if name and table in _TABLES:
            out.setdefault(table, {})[name] = value
        else:
            out[key] = value
    return out


def train_config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown TrainConfig key(s) {unknown}; valid keys: {sorted(_FIELDS)}")
    values = {key: _coerce(key, value) for key, value in raw.items()}
    return TrainConfig(**values)


def train_config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain types only (tuples as lists), so yaml.safe_dump / a TOML writer can store it."""
    out = dataclasses.asdict(cfg)
    out["betas"] = list(cfg.betas)
    return out


def _coerce(key: str, value: Any) -> Any:
    """Check a value against the field's default type; ints are accepted where floats are."""
    default = _default(key)

    def wrong(expected: str):
        return ValueError(f"TrainConfig.{key}={value!r}: expected {expected}")

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise wrong("true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
    elif isinstance(default, float):
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise wrong("a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong("a number")
        value = float(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise wrong("a string")
    elif isinstance(default, tuple):
        if not isinstance(value, list | tuple) or not all(isinstance(v, int | float) for v in value):
            raise wrong("a list of numbers, e.g. [0.9, 0.95]")
        value = tuple(float(v) for v in value)
    elif isinstance(default, dict):
        if not isinstance(value, dict):
            raise wrong(f"a mapping of {'ModelConfig' if key == 'model' else 'ParallelConfig'} keys")
    return value


def _default(key: str) -> Any:
    f = _FIELDS[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
