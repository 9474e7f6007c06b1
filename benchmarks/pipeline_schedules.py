"""Pipeline schedules side by side: the same model, data and micro-batches on 2 gloo ranks under
1F1B, Interleaved1F1B, ZBVZeroBubble and DualPipeV. Prints the median training-step time (forward +
backward over all micro-batches + AdamW) of several steps, taken round-robin, and its ratio to 1F1B.

    python benchmarks/pipeline_schedules.py [--layers 8] [--microbatches 8] [--steps 6]

CPU gloo ranks share this machine's cores, so the numbers measure schedule overheads and bubbles
under contention, not GPU behaviour; rerun to see the noise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


def rank_main(rank: int, world: int, tmp: str, args) -> None:
    sys.path.insert(0, str(ROOT))
    from seekforge.config import ParallelConfig, preset
    from seekforge.model.model import build_model
    from seekforge.parallel.mesh import build_mesh
    from seekforge.parallel.pp import PipelineRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    cfg = preset("tiny", num_hidden_layers=args.layers)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    runners = {}
    for schedule in SCHEDULES:
        pc = ParallelConfig(pp=world, pp_schedule=schedule, microbatches=args.microbatches)
        runner = PipelineRunner(build_model(cfg, seed=0), pc, build_mesh(pc, cfg))
        runners[schedule] = (runner, torch.optim.AdamW(runner.parameters(), lr=1e-4))
    times = {schedule: [] for schedule in SCHEDULES}
    # Round-robin over schedules, so drifting load on the shared machine hits all of them alike; the
    # first round (shape inference, allocator warm-up) is not timed.
    for step in range(args.steps + 1):
        for schedule, (runner, opt) in runners.items():
            dist.barrier()
            start = time.perf_counter()
            runner.step(inputs, labels)
            runner.sync_tied_embedding_grads()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if step:
                times[schedule].append(time.perf_counter() - start)
    results = {schedule: statistics.median(t) for schedule, t in times.items()}
    if rank == 0:
        base = results["1F1B"]
        print(f"tiny preset, {args.layers} layers, batch {args.batch} x seq {args.seq}, "
              f"{args.microbatches} micro-batches, {world} gloo ranks, median of {args.steps} steps")
        print(f"{'schedule':<18}{'step ms':>10}{'vs 1F1B':>10}")
        for schedule, seconds in results.items():
            print(f"{schedule:<18}{seconds * 1e3:>10.1f}{seconds / base:>10.2f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from machine import machine_header  # benchmarks/machine.py

    # fp32: the pipeline's step times here are schedule overheads and bubbles, not matmul speed.
    machine_header("fp32", probe_peak=False)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(2, tmp, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
