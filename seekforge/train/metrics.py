"""Where training metrics go: one JSON line per step (the exact record), TensorBoard scalars, and
a loss-curve PNG at the end. Only rank 0 writes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path


class MetricsLogger:
    def __init__(self, out_dir: str | Path, enabled: bool = True):
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._file = self._tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when logging

            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.jsonl_path, "a")  # append: a resumed run continues the same file
            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        """metrics: scalars, or lists of scalars (one per MoE layer) logged as `name/layer_i`."""
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        for name, value in metrics.items():
            if isinstance(value, list):
                for i, v in enumerate(value):
                    self._tb.add_scalar(f"{name}/layer_{i}", v, step)
            elif isinstance(value, int | float):
                self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


def start_over(out_dir: str | Path, plot: str) -> None:
    """Remove an earlier run's records from `out_dir` (a fresh start, --no-resume): its checkpoints, and its metrics,
    TensorBoard events and `plot`, which would otherwise mix into the new run's (TensorBoard draws both as one
    curve)."""
    out_dir = Path(out_dir)
    for file in ("metrics.jsonl", plot):
        (out_dir / file).unlink(missing_ok=True)
    for folder in ("checkpoints", "tensorboard"):
        shutil.rmtree(out_dir / folder, ignore_errors=True)


def read_metrics(jsonl_path: str | Path) -> list[dict]:
    """The JSONL records; after a resume, a step logged twice keeps its last record."""
    by_step: dict[int, dict] = {}
    for line in Path(jsonl_path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def plot_loss_curve(jsonl_path: str | Path, png_path: str | Path, baseline: float | None = None) -> Path:
    """Training loss (and eval loss when logged) vs step; `baseline` draws the unigram entropy."""
    records = read_metrics(jsonl_path)
    key = "lm_loss" if any("lm_loss" in r for r in records) else "loss"  # pipeline runs log the total only
    series = [(key, f"train {key.replace('_', ' ')}", "-"), ("eval_loss", "eval lm loss", "o-")]
    hline = (baseline, f"unigram entropy {baseline:.2f}") if baseline is not None and math.isfinite(baseline) else None
    return plot_metrics(records, png_path, series, "optimizer step", "cross-entropy (nats/token)", hline)


def plot_metrics(records: list[dict], png_path: str | Path, series: list[tuple[str, str, str]], xlabel: str,
                 ylabel: str, hline: tuple[float, str] | None = None) -> Path:
    """One line per (metric key, label, matplotlib format) over the records that hold the key; `hline`:
    a (value, label) reference line."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, fmt in series:
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), fmt, label=label, linewidth=1 if fmt == "-" else None)
    if hline is not None:
        ax.axhline(hline[0], color="gray", linestyle="--", label=hline[1])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
