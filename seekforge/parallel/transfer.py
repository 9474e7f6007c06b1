"""The in-memory resharding executor: run a plan (parallel/reshard.py) over torch.distributed
point-to-point, bucketed to a memory cap. Every rank of the default process group calls it with the same plan
(ranks are global ranks).

    src = shards_of(train_model); dst = shards_of(engine_model)        # {name: [(box, local tensor)]}
    stats = sync_shards(layout_of_model(train_model), layout_of_model(engine_model), src, dst)

Rounds: the plan's remote transfers are packed first-fit into rounds in which no rank sends plus
receives more than `memory_cap` bytes (a single transfer above the cap gets a round of its own).
Within a round, everything one rank sends another travels as one flat byte buffer; the round's
sends and receives go out together through `dist.batch_isend_irecv` (NCCL coalesces them; gloo
runs them as plain isend/irecv). Local copies (data already on the destination rank) never touch the
network. Values arrive in the source dtype and are cast into the destination tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from seekforge.parallel.layout import Box, Layout, named_tensors, tensor_placement
from seekforge.parallel.reshard import Transfer, plan_bytes, plan_reshard

Shards = dict[str, list[tuple[Box, torch.Tensor]]]


def shards_of(modules) -> Shards:
    """This rank's local tensors of a (possibly parallelized) model by full-model name, each with the
    global box it covers. Writing into them writes the model's parameters (DTensor locals are views)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: Shards = {}
    for name, tensors in named_tensors(modules if modules is not None else []).items():
        for t in tensors:
            placement = tensor_placement(t, rank)
            box = dict(placement.boxes(tuple(t.shape)))[rank]
            local = t.to_local() if hasattr(t, "to_local") else t
            out.setdefault(name, []).append((box, local.data))
    return out


def allocate_shards(layout: Layout, rank: int, dtype: torch.dtype | None = None, device="cpu") -> Shards:
    """Empty local tensors for `rank`'s boxes of a described layout (an engine that is not built by
    parallelize, or a check)."""
    out: Shards = {}
    for name, t in layout.tensors.items():
        for box in t.rank_boxes().get(rank, []):
            out.setdefault(name, []).append(
                (box, torch.empty([b - a for a, b in box], dtype=dtype or t.dtype, device=device)))
    return out


def _region(tensor: torch.Tensor, region: Box, box: Box) -> torch.Tensor:
    """The view of `tensor` (which covers `box`) holding the global `region`."""
    return tensor[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(region, box, strict=True))]


def _lookup(shards: Shards, name: str, box: Box) -> list[torch.Tensor]:
    found = [t for b, t in shards.get(name, []) if b == box]
    if not found:
        raise ValueError(f"this rank has no local tensor for {name} box {box}; the shards do not match the layout "
                         "the plan was made from (plan and shards must describe the same models)")
    return found


def rounds(plan: list[Transfer], memory_cap: int) -> list[list[Transfer]]:
    """Remote transfers packed first-fit into rounds where each rank's sent + received bytes stay
    within memory_cap. Deterministic: every rank derives the same rounds from the same plan."""
    out: list[list[Transfer]] = []
    used: list[dict[int, int]] = []
    for t in plan:
        if not t.remote:
            continue
        i = next((i for i, load in enumerate(used)
                  if max(load.get(t.src_rank, 0), load.get(t.dst_rank, 0)) + t.nbytes <= memory_cap), None)
        if i is None:
            i = len(out)
            out.append([])
            used.append({})
        out[i].append(t)
        for r in (t.src_rank, t.dst_rank):
            used[i][r] = used[i].get(r, 0) + t.nbytes
    return out


@dataclass
class SyncStats:
    bytes_sent: int  # by this rank
    bytes_received: int
    bytes_moved: int  # by all ranks: the plan's total
    rounds: int
    seconds: float


@torch.no_grad()
def execute(plan: list[Transfer], src_dtypes: dict[str, torch.dtype], src: Shards, dst: Shards,
            memory_cap: int = 256 * 2**20) -> SyncStats:
    """Run `plan` on this rank: local copies, then the remote rounds. `src_dtypes`: each tensor's
    dtype in the source layout (what goes over the wire)."""
    me = dist.get_rank()
    start = time.perf_counter()
    for t in plan:
        if not t.remote and t.dst_rank == me:
            value = _region(_lookup(src, t.name, t.src_box)[0], t.region, t.src_box)
            for target in _lookup(dst, t.name, t.dst_box):
                _region(target, t.region, t.dst_box).copy_(value)
    sent = received = 0
    all_rounds = rounds(plan, memory_cap)
    for round_ in all_rounds:
        outgoing: dict[int, list[Transfer]] = {}
        incoming: dict[int, list[Transfer]] = {}
        for t in round_:
            if t.src_rank == me:
                outgoing.setdefault(t.dst_rank, []).append(t)
            if t.dst_rank == me:
                incoming.setdefault(t.src_rank, []).append(t)
        ops, buffers = [], {}
        for peer, ts in sorted(outgoing.items()):
            flat = torch.cat([_region(_lookup(src, t.name, t.src_box)[0], t.region, t.src_box)
                              .contiguous().view(-1).view(torch.uint8) for t in ts])
            ops.append(dist.P2POp(dist.isend, flat, peer))
            sent += flat.numel()
        for peer, ts in sorted(incoming.items()):
            buffers[peer] = torch.empty(sum(t.nbytes for t in ts), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, buffers[peer], peer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for peer, ts in incoming.items():
            for t, piece in zip(ts, buffers[peer].split([t.nbytes for t in ts]), strict=True):
                shape = [b - a for a, b in t.region]
                dtype = src_dtypes[t.name]
                if piece.storage_offset() % dtype.itemsize:  # packed after a narrower dtype: realign
                    piece = piece.clone()
                value = piece.view(dtype).view(shape)  # (region) in the source dtype
                for target in _lookup(dst, t.name, t.dst_box):
                    _region(target, t.region, t.dst_box).copy_(value)
            received += buffers[peer].numel()
    return SyncStats(sent, received, plan_bytes(plan), len(all_rounds), time.perf_counter() - start)


def sync_shards(src_layout: Layout, dst_layout: Layout, src: Shards, dst: Shards,
                memory_cap: int = 256 * 2**20) -> SyncStats:
    """Plan and run src_layout → dst_layout on every rank of the group."""
    plan = plan_reshard(src_layout, dst_layout)
    dtypes = {name: t.dtype for name, t in src_layout.tensors.items()}
    return execute(plan, dtypes, src, dst, memory_cap)
