"""Simulated (plan/schedule.py) vs measured (benchmarks/pipeline_schedules.py) step-time ratios of the
pipeline schedules, on the same model, batch and ranks.

    python benchmarks/plan_schedules.py [--steps 6]

Stage costs for the simulator come from plan/profile.py: each layer and the tail (head, MTP, loss)
timed forward + backward on this machine for one micro-batch, split F : B : W = 1 : 1 : 1 (the FLOP
convention), the layers cut as parallel/pp.py cuts them. Then the measured benchmark runs on 2 gloo
ranks in a subprocess and both ratio columns are printed side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seekforge.config import preset  # noqa: E402
from seekforge.plan.profile import profile_times  # noqa: E402
from seekforge.plan.schedule import StageCost, simulate, stages_per_rank  # noqa: E402

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")  # as pipeline_schedules.py


def simulated(layers: int, batch: int, seq: int, microbatches: int, pp: int = 2) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = preset("tiny", num_hidden_layers=layers)
    layer_times, tail_time = profile_times(cfg, batch // microbatches, seq, torch.float32, repeats=5)
    out = {}
    for schedule in SCHEDULES:
        stages = pp * stages_per_rank(schedule)
        bounds = [round(i * layers / stages) for i in range(stages + 1)]
        costs = []
        for s in range(stages):
            t = float(layer_times[bounds[s]:bounds[s + 1]].sum()) + (tail_time if s == stages - 1 else 0.0)
            costs.append(StageCost(t / 3, t / 3, t / 3))
        out[schedule] = simulate(schedule, costs, microbatches).step_time
    return out


def measured(args) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pipeline_schedules.py"), "--layers", str(args.layers),
           "--microbatches", str(args.microbatches), "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps)]
    text = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+)\s+([\d.]+)\s+[\d.]+$", text, re.M)}
    return {s: rows[s] / 1e3 for s in SCHEDULES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, fp32, tiny preset {args.layers} layers, "
          f"batch {args.batch} x {args.seq}, {args.microbatches} micro-batches, 2 pipeline ranks")
    sim = simulated(args.layers, args.batch, args.seq, args.microbatches)
    real = measured(args)
    print(f"{'schedule':<18}{'simulated ms':>14}{'vs 1F1B':>9}{'measured ms':>13}{'vs 1F1B':>9}")
    for s in SCHEDULES:
        print(f"{s:<18}{sim[s] * 1e3:>14.1f}{sim[s] / sim['1F1B']:>9.2f}{real[s] * 1e3:>13.1f}"
              f"{real[s] / real['1F1B']:>9.2f}")


if __name__ == "__main__":
    main()
