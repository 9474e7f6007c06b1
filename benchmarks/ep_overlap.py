"""Expert all-to-all overlap (TrainConfig.overlap, parallel/overlap.py): the training step with each
micro-batch's forward running beside the previous one's backward vs the sequential accumulation loop.

2 gloo ranks on this CPU, ep=2 (FSDP over dp_shard=2), fp32, the real Trainer.train_step. Two models built
from the same seed train side by side on the same batches, one per contender, their steps interleaved
(A B, then B A, ...) so a drift of the shared machine's speed hits both alike; every step's loss and grad
norm must be bit-identical between them (checked). A step's time is the slowest rank's. The headline is the
median over repetitions of the ratio sequential / overlap of one repetition's two adjacent steps (> 1: overlap
is faster): on shared cores the neighbours' load swings several-fold within a minute. With --pp: DualPipeV on
pp=2 × ep=2 (4 ranks), its overlapped forward/backward pairs run at once or one after the other. The share of a
sequential step the forward spends waiting on its exchanges (the dispatchers' wait_seconds) says how much
there is to hide. Overlap also holds FSDP's parameters gathered over the step's micro-batches (a forward and a
backward may not interleave FSDP's hooks), which the sequential loop re-gathers each micro-batch: the third
contender, "held", runs overlap's path with the concurrency off (accumulate(concurrent=False)), so held / overlap
is what running the two micro-batches at once buys by itself, and sequential / held what gathering once buys.

    PYTHONPATH=. python benchmarks/ep_overlap.py [--threads 1] [--reps 8] [--grad-accum 4] [--batch 2] [--seq 64]
    PYTHONPATH=. python benchmarks/ep_overlap.py --pp --batch 8    # DualPipeV's F&B pairs, pp=2 × ep=2 on 4 ranks
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from statistics import median
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_header  # noqa: E402

from seekforge.config import ParallelConfig, TrainConfig, preset  # noqa: E402

WORLD = 2  # ranks of one pipeline stage's expert group (the whole world without --pp)


def model_config(args):
    return preset(args.preset, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_nextn_predict_layers=0)


class Batches:
    """This rank's half of a fixed set of random global batches, cycled (state methods for the Trainer)."""

    def __init__(self, cfg, args, dp_rank: int):
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (args.grad_accum, WORLD * args.batch, args.seq + 1), generator=gen)
        rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
        self.batches = [{"input_ids": t[rows, :-1], "labels": t[rows, 1:]} for t in tokens]
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def build_trainer(cfg, args, overlap: bool, out_dir: str):
    from seekforge.model.model import build_model
    from seekforge.parallel.mesh import build_mesh
    from seekforge.parallel.parallelize import parallelize
    from seekforge.parallel.pp import PipelineRunner
    from seekforge.train.trainer import Trainer

    pipeline = dict(pp=2, pp_schedule="DualPipeV", microbatches=args.batch) if args.pp else {}
    pc = ParallelConfig(dp_shard=WORLD, ep=WORLD, **pipeline)
    mesh = build_mesh(pc, cfg)
    tc = TrainConfig(preset=args.preset, dtype="fp32", seq_len=args.seq, micro_batch_size=WORLD * args.batch,
                     grad_accum=1 if args.pp else args.grad_accum, steps=10**6, lr=1e-4, min_lr=1e-5, warmup=0,
                     peak_flops=1e12, overlap=overlap, out_dir=out_dir, mtp_loss_scale=0.0)
    model = build_model(cfg, seed=0)
    model = PipelineRunner(model, pc, mesh, tc.mtp_loss_scale) if args.pp else parallelize(model, pc, mesh)
    return Trainer(tc, model, Batches(cfg, args, mesh["dp"].get_local_rank()), mesh=mesh)


def timed_step(trainer, concurrent: bool = True) -> tuple[float, float, dict, float]:
    """→ (the slowest rank's seconds, CPU seconds of all ranks' processes (every thread, gloo's too), the
    step's metrics, this rank's forward exchange-wait seconds). concurrent=False: the "held" control."""
    from seekforge.parallel import overlap
    from seekforge.train import trainer as trainer_module

    for moe in trainer.moe_layers:
        moe.dispatcher.wait_seconds = 0.0
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    with mock.patch.object(trainer_module, "accumulate", partial(overlap.accumulate, concurrent=concurrent)):
        metrics = trainer.train_step()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    cpu_seconds = torch.tensor(time.process_time() - cpu, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu_seconds)
    return seconds.item(), cpu_seconds.item(), metrics, sum(m.dispatcher.wait_seconds for m in trainer.moe_layers)


def run_rank(rank: int, tmp: str, args) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size(args),
                            timeout=datetime.timedelta(seconds=300))
    cfg = model_config(args)
    names = ("sequential", "overlap") if args.pp else ("sequential", "held", "overlap")
    trainers = {name: build_trainer(cfg, args, name != "sequential", tmp) for name in names}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    waits, identical = [], True
    for rep in range(args.warmup + args.reps):
        order = list(names[rep % len(names):] + names[:rep % len(names)])  # each goes first in turn
        metrics = {}
        for name in order:
            seconds, cpu_seconds, metrics[name], wait = timed_step(trainers[name], concurrent=name != "held")
            if rep >= args.warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                if name == "sequential":
                    waits.append(wait / seconds)
        identical &= all(metrics[name][k] == metrics["sequential"][k] for name in names for k in ("loss", "grad_norm"))
    if rank == 0:
        for name in names:
            reps = ", ".join(f"{1e3 * x:.0f}" for x in times[name])
            print(f"{name + ':':<11} {1e3 * median(times[name]):.1f} ms/step, "
                  f"{1e3 * median(cpu[name]):.0f} CPU ms/step over all ranks (per rep: {reps})")
        print(f"sequential step's forward exchange waits (rank 0): {100 * median(waits):.0f}% of the step")
        pairs = [("sequential", "overlap")] + ([("held", "overlap"), ("sequential", "held")] if "held" in names else [])
        for a, b in pairs:
            paired = [x / y for x, y in zip(times[a], times[b], strict=True)]
            print(f"ratio {a} / {b}: {median(paired):.2f}x (median of the {len(paired)} per-repetition ratios, "
                  f"steps of one repetition adjacent; of the medians: {median(times[a]) / median(times[b]):.2f}x)")
        same = "yes" if identical else "NO"
        print(f"losses and grad norms bit-identical over {args.warmup + args.reps} steps: {same}")
    dist.barrier()
    dist.destroy_process_group()


def world_size(args) -> int:
    return 2 * WORLD if args.pp else WORLD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per micro-batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pp", action="store_true", help="DualPipeV on pp=2 × ep=2 (4 ranks; one step = --batch "
                        "micro-batches of one sequence per rank) instead of gradient accumulation")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine_header("fp32", probe_peak=False)
    cfg = model_config(args)
    if args.pp and args.batch < 4:
        parser.error("--pp needs --batch >= 4: DualPipeV runs at least as many micro-batches as its 4 stages")
    layout = "pp=2 (DualPipeV) × ep=2" if args.pp else "ep=2"
    steps = f"{args.batch} micro-batches of 1x" if args.pp else f"{args.grad_accum} micro-batches of {args.batch}x"
    print(f"{world_size(args)} gloo ranks, {layout} (FSDP dp_shard=2), {args.threads} torch thread(s) per rank; "
          f"{args.preset} preset with hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} "
          f"experts top-{cfg.num_experts_per_tok}; {steps}{args.seq} tokens per rank")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(tmp, args), nprocs=world_size(args), join=True)


if __name__ == "__main__":
    main()
