"""Probe overhead on the `small` preset's training step: the step with seekforge's probe in each
mode against the same step without it, in one process, the variants interleaved step by step (the
order rotated every round) so that load drift on shared cores hits them all alike.

  baseline        Trainer.train_step with no probe config (the always-on phase timer and trace
                  trigger check only: a clock read per phase and a stat per step)
  monitor         the statistics monitor with its defaults: every block's output and output-gradient
                  statistics and the anomaly rules every step, a record (weight-gradient, Adam-moment
                  and update-ratio norms, expert loads) every 10 steps — must stay under 10%
  monitor:every-step   the same with a record every step
  dump:statistics every module's inputs, outputs and gradients as statistics, written every step
  dump:tensor     the blocks' outputs and output gradients as tensors (safetensors), every step

Same model (small preset, MTP off as in train_step.py), same fixed batch (8 × 256), the dtype
below (bf16 autocast where the CPU has AVX512, else fp32). Printed per variant: the best and the
median wall time per step over the interleaved steps (on shared cores the best is the step the
neighbours disturbed least), the best process CPU time, and what the probe wrote per step.

    PYTHONPATH=. python benchmarks/probe_overhead.py [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from train_step import RepeatLoader  # benchmarks/train_step.py: the same batch forever

from seekforge.config import TrainConfig
from seekforge.model.model import build_model
from seekforge.train.trainer import Trainer

BATCH, SEQ = 8, 256
VARIANTS = {
    "baseline": None,
    "monitor": "monitor: {}\n",
    "monitor:every-step": "monitor: {interval: 1}\n",
    "dump:statistics": "dump: {mode: statistics, out_dir: dump}\n",
    "dump:tensor": "dump: {mode: tensor, modules: ['re:layers\\.\\d+'], slots: [output], out_dir: dump}\n",
}


def make_trainer(probe_yaml: str | None, out_dir: Path, dtype: str) -> Trainer:
    out_dir.mkdir(parents=True)
    probe = ""
    if probe_yaml:
        probe = str(out_dir / "probe.yaml")
        Path(probe).write_text(probe_yaml)
    cfg = TrainConfig(preset="small", model={"num_nextn_predict_layers": 0}, seq_len=SEQ, micro_batch_size=BATCH,
                      steps=1000, mtp_loss_scale=0.0, peak_flops=1.0, dtype=dtype, probe=probe)
    model = build_model(cfg.model_config(), seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
    loader = RepeatLoader({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return Trainer(cfg, model, loader, out_dir=out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    capability = torch.backends.cpu.get_cpu_capability()
    dtype = "bf16" if "AVX512" in capability else "fp32"  # AVX2-only CPUs run bf16 matmuls ~100x slower
    print(f"probe overhead, preset small (MTP off), batch {BATCH}×{SEQ}, {dtype}, CPU capability {capability}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {name: Path(tmp) / name.replace(":", "_") for name in VARIANTS}
        trainers = {name: make_trainer(yaml, dirs[name], dtype) for name, yaml in VARIANTS.items()}
        for trainer in trainers.values():
            trainer.train_step()  # warm-up: allocator, autocast caches
        wall = {name: [] for name in trainers}
        cpu = {name: [] for name in trainers}
        names = list(trainers)
        for i in range(args.steps):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotated: no variant always first
                trainer = trainers[name]
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                trainer.train_step()
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.process_time() - start_cpu)
        # The best step is the one the neighbours disturbed least: the headline on shared cores.
        base_best, base_median = min(wall["baseline"]), statistics.median(wall["baseline"])
        for name in trainers:
            best, median = min(wall[name]), statistics.median(wall[name])
            written = sum(p.stat().st_size for p in (dirs[name] / "probe").rglob("*") if p.is_file())
            print(f"{name:>16}: best {best:6.3f} s/step ({100 * (best / base_best - 1):+6.1f}%) | "
                  f"median {median:6.3f} s/step ({100 * (median / base_median - 1):+6.1f}%) | "
                  f"CPU best {min(cpu[name]):6.2f} s/step | written {written / 2**20 / (args.steps + 1):6.2f} MiB/step")


if __name__ == "__main__":
    main()
