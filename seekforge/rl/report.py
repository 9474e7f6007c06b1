"""The run's picture: reward mean per step and held-out accuracy, from metrics.jsonl. (The reward std
is in the JSONL; for 0/1 rewards a ±std band spans most of the axis and hides the trend.)"""

from __future__ import annotations

from pathlib import Path

from seekforge.train.metrics import read_metrics


def plot_reward_curve(jsonl_path: str | Path, png_path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r for r in records if "reward_mean" in r]
    if steps:
        ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps],
                label="reward mean (training samples)", linewidth=1)
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
