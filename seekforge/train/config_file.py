"""Config dataclasses ⇄ YAML / TOML files and `key=value` command-line overrides: one loader and one
type check for the verbs' configs (pretrain's TrainConfig, grpo's GRPOConfig).

A file is a flat mapping onto the dataclass's fields, plus tables (nested mappings: `model:` of
ModelConfig overrides, `parallel:` of ParallelConfig keys) that later layers merge key by key. Unknown
keys and wrongly typed values raise ValueError naming the key, so a typo never silently trains the default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from seekforge.config import TrainConfig, read_config_file

_TABLES = {"model": "ModelConfig", "parallel": "ParallelConfig"}  # nested mappings → the keys they hold


def load_config(cls: type, path: str | Path | None = None, *layers: list[str] | dict | None):
    """Defaults ← file (YAML or TOML, by extension) ← each layer in turn ("key=value" strings or a dict).
    A table set in several places merges key by key; any other key: the last one wins."""
    raw: dict[str, Any] = read_config_file(path, f"{cls.__name__} keys") if path else {}
    for layer in layers:
        updates = dict(layer) if isinstance(layer, dict) else parse_overrides(layer or [])
        for key in _TABLES:
            if isinstance(raw.get(key), dict) and isinstance(updates.get(key), dict):
                updates[key] = {**raw[key], **updates[key]}
        raw.update(updates)
    return config_from_dict(cls, {key: value for key, value in raw.items() if not (key in _TABLES and value == {})})


def load_train_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    return load_config(TrainConfig, path, overrides)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["lr=1e-3", "model.num_hidden_layers=2", "parallel.tp=2"] → {"lr": "1e-3", "model":
    {"num_hidden_layers": 2}, "parallel": {"tp": 2}}. Values are parsed as YAML scalars/lists, so
    `betas=[0.9,0.99]` and `compile=true` work (a float field takes YAML 1.1's string "1e-3")."""
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


def config_from_dict(cls: type, raw: dict[str, Any]):
    """A mapping of `cls`'s fields → the config (its own __post_init__ checks the values' ranges). A field whose
    metadata has `also_bool` takes true / false besides its default's type (GRPOConfig.scale_rewards)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; valid keys: {sorted(fields)}")
    return cls(**{key: value if isinstance(value, bool) and fields[key].metadata.get("also_bool")
                  else _coerce(f"{cls.__name__}.{key}", _default(fields[key]), value) for key, value in raw.items()})


def command_line(args, fields: list[str]) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """A training verb's command line as load_config's sources (its flags default to argparse.SUPPRESS, so
    `args` holds only what the user typed): the --config file, the flags among `fields`, the --set overrides."""
    given = vars(args)
    return (given.get("config"), {field: given[field] for field in fields if field in given},
            parse_overrides(given.get("overrides", [])))


def interrupt_hint_of(cfg) -> str:
    """What Ctrl-C says about a run of `cfg` (a TrainConfig or GRPOConfig; seekforge/cli.py asks the verb's
    on_interrupt): how to go on from its checkpoints."""
    from seekforge.train.checkpoint import interrupt_hint

    return interrupt_hint(cfg.out_dir, cfg.save_interval)


def config_to_dict(cfg) -> dict[str, Any]:
    """Plain types only (tuples as lists), so yaml.safe_dump / a TOML writer can store it."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(cfg).items()}


def _coerce(name: str, default: Any, value: Any) -> Any:
    """Check a value against the field's default type: ints are accepted where floats are, a number in a
    string where a float is (YAML 1.1 reads `1e-3` as one), one item where a list is (--set rewards=format)."""

    def wrong(expected: str):
        return ValueError(f"{name}={value!r}: expected {expected}")

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise wrong("true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
    elif isinstance(default, float):
        if isinstance(value, str):
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
    elif isinstance(default, list):
        items = list(value) if isinstance(value, list | tuple) else [value]
        value = [_coerce(f"{name}[{i}]", default[0], item) for i, item in enumerate(items)] if default else items
    elif isinstance(default, dict):
        table = name.rpartition(".")[2]
        if not isinstance(value, dict):
            raise wrong(f"a mapping of {_TABLES[table]} keys" if table in _TABLES else "a mapping")
    return value


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default is dataclasses.MISSING else field.default
