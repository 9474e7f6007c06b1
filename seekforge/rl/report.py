"""The run's picture: reward mean per step and held-out accuracy, from metrics.jsonl. (The reward std
is in the JSONL; for 0/1 rewards a ±std band spans most of the axis and hides the trend.)"""

from __future__ import annotations

from pathlib import Path

from seekforge.train.metrics import plot_metrics, read_metrics


def plot_reward_curve(jsonl_path: str | Path, png_path: str | Path) -> Path:
    series = [("reward_mean", "reward mean (training samples)", "-"),
              ("eval_accuracy", "held-out accuracy (greedy)", "o-")]
    return plot_metrics(read_metrics(jsonl_path), png_path, series, "GRPO step", "reward / accuracy")
