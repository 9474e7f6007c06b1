"""The stage balancer (plan/balance.py): its split against parallel/pp.py's even split.

    python benchmarks/plan_balance.py [--steps 6] [--skip-measure]

1. v3-671b, pp = 16 (1F1B, 32 micro-batches of 1 x 4096, dp_shard = ep = 64), 70 GB per stage,
   analytic costs at 400 TFLOP/s: balanced split and recompute vs the fastest even split that fits,
   in the event simulator.
2. small preset, pp = 2 on 2 gloo ranks (1F1B, 4 micro-batches of 2 x 256, bf16 autocast): layer
   times profiled on this machine (plan/profile.py), the balanced split and the even split trained
   side by side (round-robin steps, median), simulated and measured step-time ratios.
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
sys.path.insert(0, str(ROOT))

from seekforge.config import ParallelConfig, preset  # noqa: E402
from seekforge.plan.balance import (  # noqa: E402
    MODES,
    analytic_costs,
    balance_stages,
    even_split,
    inflight_per_stage,
    simulated_step,
)

SMALL_BATCH, SMALL_SEQ, SMALL_MICROBATCHES = 8, 256, 4


def v3_gain() -> None:
    cfg = preset("v3-671b")
    pc = ParallelConfig(pp=16, microbatches=32, dp_shard=64, ep=64, mixed_precision="bf16")
    start = time.perf_counter()
    costs = analytic_costs(cfg, pc, 1, 4096, 400e12)
    inflight = inflight_per_stage(pc)
    limit = 70e9
    best = balance_stages(costs, 16, 32, limit, inflight)
    seconds = time.perf_counter() - start
    evens = [e for e in (even_split(costs, 16, 32, m, inflight) for m in MODES) if max(e.stage_memory) <= limit]
    even = min(evens, key=lambda e: e.step_time)
    sim_best = simulated_step(costs, best, "1F1B", 16, 32)
    sim_even = simulated_step(costs, even, "1F1B", 16, 32)
    print(f"[v3-671b pp=16] balanced in {seconds:.1f} s: split {best.split_points}, recompute per stage "
          f"{best.recompute}")
    print(f"[v3-671b pp=16] simulated step: balanced {sim_best:.3f} s, even split (recompute={even.recompute[0]}) "
          f"{sim_even:.3f} s: step time {sim_best / sim_even - 1:+.1%}, tokens/s x{sim_even / sim_best:.2f}")


def rank_main(rank: int, world: int, tmp: str, splits: dict, steps: int, out: dict) -> None:
    from seekforge.model.model import build_model
    from seekforge.parallel.mesh import build_mesh
    from seekforge.parallel.pp import PipelineRunner

    torch.set_num_threads(1)
    # One core per rank: a rank's idle wait must not lend its core to its peer, or the wall time
    # measures the total work instead of the pipeline (the point of balancing stages).
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    cfg = preset("small")
    tokens = torch.randint(0, cfg.vocab_size, (SMALL_BATCH, SMALL_SEQ + 1), generator=torch.Generator().manual_seed(0))
    runners = {}
    for name, points in splits.items():
        pc = ParallelConfig(pp=world, microbatches=SMALL_MICROBATCHES, pp_split_points=points)
        runner = PipelineRunner(build_model(cfg, seed=0), pc, build_mesh(pc, cfg), compute_dtype=torch.bfloat16)
        runners[name] = (runner, torch.optim.AdamW(runner.parameters(), lr=1e-4))
    times = {name: [] for name in splits}
    cpu = {name: [] for name in splits}  # this rank's own CPU seconds: its share of the work
    for step in range(steps + 1):  # round-robin; the first round (shape inference) is not timed
        for name, (runner, opt) in runners.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            runner.step(tokens[:, :-1], tokens[:, 1:])
            runner.sync_tied_embedding_grads()
            opt.step()
            opt.zero_grad()
            used = time.process_time() - start_cpu
            dist.barrier()
            if step:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(used)
    medians = torch.tensor([statistics.median(cpu[name]) for name in splits], dtype=torch.float64)
    gathered = [torch.zeros_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)
    if rank == 0:
        out.update({name: statistics.median(t) for name, t in times.items()})
        out.update({f"{name} cpu": [float(g[i]) for g in gathered] for i, name in enumerate(splits)})
    dist.barrier()
    dist.destroy_process_group()


def small_measured(steps: int, measure: bool) -> None:
    from seekforge.plan.profile import profile_times, with_profiled_times

    torch.set_num_threads(1)
    cfg = preset("small")
    pc = ParallelConfig(pp=2, microbatches=SMALL_MICROBATCHES)
    mbs = SMALL_BATCH // SMALL_MICROBATCHES
    layer_times, tail_time = profile_times(cfg, mbs, SMALL_SEQ, torch.bfloat16)
    costs = with_profiled_times(analytic_costs(cfg, pc, mbs, SMALL_SEQ, 1e12, flash_attention=False),
                                layer_times, tail_time)
    best = balance_stages(costs, 2, SMALL_MICROBATCHES, 1e12, modes=("none",))
    even = even_split(costs, 2, SMALL_MICROBATCHES, "none")
    sim_best = simulated_step(costs, best, "1F1B", 2, SMALL_MICROBATCHES)
    sim_even = simulated_step(costs, even, "1F1B", 2, SMALL_MICROBATCHES)
    print(f"[small pp=2] profiled ms per layer (fwd+bwd): {[round(t * 1e3) for t in layer_times]}, "
          f"tail (head + MTP + loss) {tail_time * 1e3:.0f}")
    print(f"[small pp=2] balanced split {best.split_points} vs even {even.split_points}: simulated "
          f"{sim_best * 1e3:.0f} vs {sim_even * 1e3:.0f} ms, ratio {sim_best / sim_even:.2f}")
    if not measure:
        return
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    splits = {"balanced": best.split_points, "even": even.split_points}
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(2, tmp, splits, steps, out), nprocs=2, join=True)
        print(f"[small pp=2] measured on 2 gloo ranks, median of {steps} steps: "
              f"balanced {out['balanced'] * 1e3:.0f} ms, even {out['even'] * 1e3:.0f} ms, "
              f"ratio {out['balanced'] / out['even']:.2f}")
        for name in splits:
            per_rank = out[f"{name} cpu"]
            print(f"[small pp=2] {name}: CPU seconds per step on each rank {[round(c, 2) for c in per_rank]}, "
                  f"slowest rank {max(per_rank):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-measure", action="store_true")
    args = parser.parse_args()
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    v3_gain()
    small_measured(args.steps, not args.skip_measure)


if __name__ == "__main__":
    main()
