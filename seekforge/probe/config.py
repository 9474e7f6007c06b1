"""The probe's settings: plain dataclasses that a YAML file maps onto 1:1.

    dump:    {mode: statistics, modules: ["layers.*"], steps: [3], directions: [forward, backward]}
    monitor: {modules: ["layers.*"], interval: 1, grad_spike_factor: 10}
    trace:   {port: 9400, steps: 3}

Module patterns are shell-style (`fnmatch`) over dotted module names (`layers.1.self_attn`), or a
regular expression when written `re:PATTERN` (matched with `re.fullmatch`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from seekforge.config import read_config_file

DUMP_MODES = ("statistics", "tensor", "md5")
DIRECTIONS = ("forward", "backward")
SLOTS = ("input", "output")


@dataclass
class DumpConfig:
    mode: str = "statistics"  # statistics | tensor (also writes safetensors) | md5 (also a hash per tensor)
    modules: list[str] = field(default_factory=lambda: ["*"])
    steps: list[int] = field(default_factory=list)  # [] = every step; pretrain counts from 1, as metrics.jsonl
    ranks: list[int] = field(default_factory=list)  # [] = every rank
    directions: list[str] = field(default_factory=lambda: list(DIRECTIONS))
    slots: list[str] = field(default_factory=lambda: list(SLOTS))  # forward inputs/outputs, grads of both
    out_dir: str = "probe_dump"

    def __post_init__(self):
        check_choice("dump.mode", [self.mode], DUMP_MODES)
        check_choice("dump.directions", self.directions, DIRECTIONS)
        check_choice("dump.slots", self.slots, SLOTS)
        compile_patterns(self.modules)


@dataclass
class MonitorConfig:
    # The blocks (their outputs are the residual stream) by default; `layers.*` would also match every
    # submodule (`*` crosses dots). The head's (B, T, V) logits cost more to summarize than a block.
    modules: list[str] = field(default_factory=lambda: ["re:layers\\.\\d+", "re:mtp\\.\\d+"])
    # Steps between records. The anomaly rules and the statistics they dump run every step; a record's
    # weight/optimizer-state norms read every parameter twice and copy it once: too costly for every step
    # (probe_overhead.py's monitor:every-step row, BENCHMARKS.md).
    interval: int = 10
    window: int = 20  # running mean over this many previous steps
    min_history: int = 3  # steps seen before spike rules fire
    loss_spike_factor: float = 3.0  # alert when loss > factor × running mean
    grad_spike_factor: float = 10.0  # alert when grad norm > factor × running mean
    dump_on_anomaly: bool = True  # write that step's module statistics under out_dir/anomaly_dumps
    tensorboard: bool = False  # also write scalars to out_dir/tensorboard_probe

    def __post_init__(self):
        compile_patterns(self.modules)
        if self.interval < 1 or self.window < 1:
            raise ValueError(f"monitor.interval={self.interval}, monitor.window={self.window}: both must be >= 1")


@dataclass
class TraceConfig:
    port: int | None = None  # serve /metrics (Prometheus) and POST /debug/trace?steps=N here; None: no server
    steps: int = 3  # steps traced per request when the request names no count
    signal: bool = True  # SIGUSR2 requests a trace (main thread only)


@dataclass
class ProbeConfig:
    dump: DumpConfig | None = None
    monitor: MonitorConfig | None = None
    trace: TraceConfig = field(default_factory=TraceConfig)


def load_probe_config(path: str | Path) -> ProbeConfig:
    """A YAML file with optional `dump`, `monitor` and `trace` tables of the dataclasses' fields."""
    raw = read_config_file(path, "probe tables (dump, monitor, trace)")
    kinds = {"dump": DumpConfig, "monitor": MonitorConfig, "trace": TraceConfig}
    unknown = set(raw) - set(kinds)
    if unknown:
        raise ValueError(f"probe config {path}: unknown tables {sorted(unknown)}; use {sorted(kinds)}")
    tables = {}
    for key, kind in kinds.items():
        if key in raw:
            table = raw[key] or {}
            bad = set(table) - {f.name for f in fields(kind)}
            if bad:
                raise ValueError(f"probe config {path}: {key} has unknown keys {sorted(bad)}; "
                                 f"known: {sorted(f.name for f in fields(kind))}")
            tables[key] = kind(**table)
    return ProbeConfig(**tables)


def check_choice(key: str, values: list[str], allowed: tuple[str, ...]) -> None:
    for value in values:
        if value not in allowed:
            raise ValueError(f"{key}: {value!r} is not one of {list(allowed)}")


def compile_patterns(patterns: list[str]) -> list[re.Pattern]:
    """Shell patterns and `re:` regular expressions → compiled full-match regexes."""
    compiled = []
    for pattern in patterns:
        source = pattern[3:] if pattern.startswith("re:") else fnmatch.translate(pattern)
        try:
            compiled.append(re.compile(source))
        except re.error as e:
            raise ValueError(f"module pattern {pattern!r} is not a valid regular expression ({e}); "
                             "write a shell pattern like 'layers.*' or 're:layers\\.\\d+'") from e
    return compiled


def module_matcher(patterns: list[str]):
    """name → True when any pattern matches the whole dotted module name."""
    compiled = compile_patterns(patterns)
    return lambda name: any(p.fullmatch(name) for p in compiled)
