"""Resharding: the box planner (parallel/reshard.py) vs gather-everything-then-scatter.

Part 1, v3-671b-shaped plan (layout math only, nothing allocated): a 2048-rank training layout
(pp=16 as DeepSeek-V3 trained, HSDP 8 replicas x 16 shards, ep=16) to a 256-rank serving layout
(dp_attention=32 × tp=8, ep=256 over all 256 ranks, which are also training ranks 0-255). Bytes moved
by the plan, its lower bound, and the bytes of the naive plan (gather each tensor on rank 0, then send
every destination its boxes); the time to plan each.

Part 2, in memory on gloo (2 ranks on this CPU): the `small` model trained under FSDP (dp_shard=2)
synced into a TP=2 engine layout: the planned executor (parallel/transfer.py) vs the peer a trainer
would write by hand, `full_tensor()` (an all-gather) of every parameter and a slice copy.

    PYTHONPATH=. python benchmarks/reshard.py
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_header  # noqa: E402

from seekforge.config import ParallelConfig, preset  # noqa: E402
from seekforge.parallel.layout import describe_engine_layout, describe_layout  # noqa: E402
from seekforge.parallel.reshard import gather_scatter_bytes, lower_bound_bytes, plan_tensor  # noqa: E402

GiB = 2**30


def plan_671b() -> None:
    cfg = preset("v3-671b")
    train_pc = ParallelConfig(pp=16, dp_replicate=8, dp_shard=16, ep=16, microbatches=16)
    start = time.perf_counter()
    src = describe_layout(cfg, train_pc, dtype=torch.bfloat16)
    dst = describe_engine_layout(cfg, tp=8, dp_attention=32, ep=256, dtype=torch.bfloat16)
    described = time.perf_counter() - start
    print(f"[671b] layouts described in {described:.1f} s: {len(src.tensors)} tensors, bf16, "
          f"{train_pc.world_size} training ranks (pp=16, HSDP 8x16, ep=16) -> {dst.world_size} serving ranks "
          "(dp_attention=32 x tp=8, ep=256)")
    # Tensor by tensor, keeping counts only: the whole plan is millions of transfers.
    start = time.perf_counter()
    load: dict[int, int] = {}  # bytes sent per rank
    received: dict[int, int] = {}
    moved = local = transfers = 0
    for name in dst.tensors:
        for t in plan_tensor(name, src.tensors[name], dst.tensors[name], load):
            if t.remote:
                moved += t.nbytes
                transfers += 1
                received[t.dst_rank] = received.get(t.dst_rank, 0) + t.nbytes
            else:
                local += t.nbytes
    planned = time.perf_counter() - start
    start = time.perf_counter()
    naive = gather_scatter_bytes(src, dst)
    naive_time = time.perf_counter() - start
    start = time.perf_counter()
    bound = lower_bound_bytes(src, dst)
    bound_time = time.perf_counter() - start
    sent = sorted(load.values())
    busiest = max(max(load.get(r, 0), received.get(r, 0)) for r in range(train_pc.world_size))
    root_traffic = naive  # every naive byte enters or leaves rank 0
    print(f"[671b] planner          : {moved / GiB:10.1f} GiB moved, {local / GiB:8.1f} GiB kept in place, "
          f"{transfers} transfers, planned in {planned:.1f} s")
    print(f"[671b] lower bound      : {bound / GiB:10.1f} GiB (planner == bound: {moved == bound}), "
          f"in {bound_time:.1f} s")
    print(f"[671b] per sender       : {len(sent)} ranks send, {sent[0] / GiB:.2f}-{sent[-1] / GiB:.2f} GiB each")
    print(f"[671b] gather + scatter : {naive / GiB:10.1f} GiB moved (all through rank 0), "
          f"counted in {naive_time:.1f} s")
    print(f"[671b] busiest rank     : planner {busiest / GiB:.1f} GiB in or out; gather + scatter: rank 0 "
          f"{root_traffic / GiB:.1f} GiB")
    print(f"[671b] ratio gather+scatter / planner bytes = {naive / moved:.2f}x; busiest-rank traffic "
          f"{root_traffic / busiest:.0f}x")


def _sync_rank(rank: int, world: int, tmp: str, repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        from seekforge.model.model import build_model
        from seekforge.parallel.layout import layout_of_model
        from seekforge.parallel.mesh import build_mesh
        from seekforge.parallel.parallelize import parallelize
        from seekforge.parallel.reshard import plan_reshard
        from seekforge.parallel.transfer import allocate_shards, execute, shards_of

        cfg = preset("small")
        pc = ParallelConfig(dp_shard=world)
        train = parallelize(build_model(cfg, seed=0), pc, build_mesh(pc, cfg))
        src_layout = layout_of_model(train)
        dst_layout = describe_engine_layout(cfg, tp=world)
        dst = allocate_shards(dst_layout, rank)
        src = shards_of(train)
        dtypes = {n: t.dtype for n, t in src_layout.tensors.items()}
        planner, naive, planning = [], [], []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            plan = plan_reshard(src_layout, dst_layout)
            planning.append(time.perf_counter() - start)
            stats = execute(plan, dtypes, src, dst, memory_cap=64 * 2**20)
            dist.barrier()
            planner.append(time.perf_counter() - start)
            start = time.perf_counter()
            with torch.no_grad():
                params = dict(train.state_dict())
                for name, pieces in dst.items():
                    full = params[name].full_tensor() if hasattr(params[name], "full_tensor") else params[name]
                    for box, t in pieces:
                        t.copy_(full[tuple(slice(a, b) for a, b in box)])
            dist.barrier()
            naive.append(time.perf_counter() - start)
        if rank == 0:
            out.update(planner=min(planner), naive=min(naive), planning=min(planning), moved=stats.bytes_moved,
                       rounds=stats.rounds,
                       params=sum(t.numel() for t in build_model(cfg, device="meta").state_dict().values()))
            torch.save(dict(out), Path(tmp) / "result.pt")
    finally:
        dist.destroy_process_group()


def sync_small(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
        mp.spawn(_sync_rank, args=(2, tmp, repeats, {}), nprocs=2, join=True)
        r = torch.load(Path(tmp) / "result.pt", weights_only=True)  # noqa: TID251 — rank 0's own numbers
    print(f"[small] {r['params'] / 1e6:.1f}M params fp32, FSDP dp_shard=2 -> TP=2 engine, gloo, 2 ranks x 1 thread, "
          f"best of {repeats}")
    print(f"[small] planner + P2P executor   : {r['planner'] * 1e3:8.1f} ms ({r['moved'] / 2**20:.1f} MiB moved, "
          f"{r['rounds']} round(s); planning {r['planning'] * 1e3:.0f} ms of it)")
    print(f"[small] full_tensor() + slice    : {r['naive'] * 1e3:8.1f} ms (all-gathers every parameter)")
    print(f"[small] ratio full_tensor / planner time = {r['naive'] / r['planner']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-671b", action="store_true")
    args = parser.parse_args()
    machine_header("fp32", probe_peak=False)
    if not args.skip_671b:
        plan_671b()
    sync_small(args.repeats)


if __name__ == "__main__":
    main()
