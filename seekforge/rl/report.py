"""The run's records beyond metrics.jsonl: the picture (reward mean per step and held-out accuracy) and the
samples file.

The picture leaves the reward std out (it is in the JSONL; for 0/1 rewards a ±std band spans most of the
axis and hides the trend). samples.jsonl holds, every sample_interval steps, each completion with its
prompt and rewards, one JSON object a line (TRL's completions table): what a reward actually scored, which
metrics cannot show. A step a resumed run repeats appends its (identical) lines again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from seekforge.train.metrics import plot_metrics, read_metrics


def plot_reward_curve(jsonl_path: str | Path, png_path: str | Path) -> Path:
    series = [("reward_mean", "reward mean (training samples)", "-"),
              ("eval_accuracy", "held-out accuracy (greedy)", "o-")]
    return plot_metrics(read_metrics(jsonl_path), png_path, series, "GRPO step", "reward / accuracy")


def append_samples(path: Path, step: int, samples, scored, tokenizer, names: list[str]) -> None:
    """samples: the step's prompts (rl/data.Sample); scored: its rl/score.ScoredBatch (group-major: completion
    j of prompt g at g·G + j). One line per completion: step, prompt, completion, each reward (None where it
    did not apply), the weighted reward and the advantage."""
    group_size = len(scored.completions) // len(samples)
    values, totals, advantages = scored.values.tolist(), scored.rewards.tolist(), scored.advantages.tolist()
    lines = []
    for i, ids in enumerate(scored.completions):
        rewards = {name: None if math.isnan(v) else v for name, v in zip(names, values[i], strict=True)}
        lines.append(json.dumps({"step": step, "prompt": samples[i // group_size].prompt,
                                 "completion": tokenizer.decode(ids), "rewards": rewards, "reward": totals[i],
                                 "advantage": advantages[i]}, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
