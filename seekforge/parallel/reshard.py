"""The resharding planner: from a source Layout to a destination Layout (any meshes, any world sizes),
the transfers that fill every destination box, as pure integer box geometry.

    plan = plan_reshard(src_layout, dst_layout)     # [Transfer], the same list on every rank
    plan_bytes(plan) == lower_bound_bytes(src_layout, dst_layout)

Per tensor and per destination (rank r, box B):
  1. what r already holds in the source (its own boxes ∩ B) is copied locally: a Transfer with
     src_rank == dst_rank, never counted as moved;
  2. the rest of B is covered by remote source boxes, largest overlap first, each region taken once
     (box subtraction keeps the remaining region a set of disjoint boxes), so the bytes moved for
     (r, B) are exactly |B \\ boxes held by r| — the lower bound;
  3. a region held by several ranks (replicas) comes from the least-loaded holder so far, so reads
     spread over replicas.
Steps 1–2 depend only on (B, r's boxes ∩ B); ranks that share them (replicas of one shard) reuse the
geometry, and when every source copy cuts the tensor the same way the regions are the box's
intersections with the source boxes, found in one vectorized test. A v3-671b plan from 2048 training
ranks to 256 serving ranks (2.5M transfers) is planned in one process (benchmarks/reshard.py times it; BENCHMARKS.md).

A destination rank may hold several boxes of one tensor (a pipeline rank with two stages holds the
embedding twice) but not two different boxes that overlap: `check_destination` refuses that.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from seekforge.parallel.layout import Box, Layout, TensorLayout, box_volume


class Transfer(NamedTuple):
    """Copy `region` (global coordinates) of tensor `name` from src_rank's box to dst_rank's box."""

    name: str
    src_rank: int
    dst_rank: int
    region: Box
    src_box: Box  # the holder's local tensor covers this box
    dst_box: Box
    nbytes: int  # in the source dtype

    @property
    def remote(self) -> bool:
        return self.src_rank != self.dst_rank


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def subtract(boxes: list[Box], cut: Box) -> list[Box]:
    """Disjoint boxes covering (∪ boxes) \\ cut, given disjoint `boxes`: each box meeting `cut` splits
    into at most 2·ndim slabs (below and above `cut` along each dim in turn)."""
    out = []
    for box in boxes:
        if intersect(box, cut) is None:
            out.append(box)
            continue
        rest = list(box)
        for d, (c0, c1) in enumerate(cut):
            lo, hi = rest[d]
            if lo < c0:
                out.append(tuple(rest[:d] + [(lo, c0)] + rest[d + 1:]))
            if c1 < hi:
                out.append(tuple(rest[:d] + [(c1, hi)] + rest[d + 1:]))
            rest[d] = (max(lo, c0), min(hi, c1))
    return out


def missing_regions(box: Box, local: list[Box]) -> list[Box]:
    """Disjoint boxes covering `box` minus every box in `local`."""
    remaining = [box]
    for cut in local:
        remaining = subtract(remaining, cut)
    return remaining


class _SourceIndex:
    """A tensor's distinct source boxes with their holders; `overlapping(B)` is one vectorized test."""

    def __init__(self, src: TensorLayout):
        pieces = src.pieces()
        self.boxes = list(pieces)
        self.holders = [pieces[b] for b in self.boxes]
        bounds = np.array(self.boxes, dtype=np.int64).reshape(len(self.boxes), len(src.shape), 2)
        self.starts, self.stops = bounds[..., 0], bounds[..., 1]
        self.by_rank: dict[int, list[Box]] = {}
        for box, ranks in pieces.items():
            for r in ranks:
                self.by_rank.setdefault(r, []).append(box)

        # Every placement cutting the tensor into the same boxes (replicas of one sharding): the distinct
        # boxes are then disjoint, and a destination box is covered by its intersections with them.
        partitions = {frozenset(b for _, b in p.boxes(src.shape) if box_volume(b)) for p in src.placements}
        self.disjoint = len(partitions) == 1

    def overlaps(self, box: Box) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ids of the source boxes meeting `box`, and their intersections' (lo, hi) corners (n, ndim)."""
        lo, hi = np.array([b[0] for b in box]), np.array([b[1] for b in box])
        lo, hi = np.maximum(self.starts, lo), np.minimum(self.stops, hi)
        ids = np.flatnonzero((lo < hi).all(axis=1))
        return ids, lo[ids], hi[ids]


def _geometry(name: str, box: Box, local: tuple[Box, ...], index: _SourceIndex) -> list[tuple[Box, Box | int]]:
    """(region, source) pairs covering `box` exactly once: a source is one of `local` (a Box: the rank
    copies from itself), or the id of a remote source box, taken by decreasing overlap."""
    ids, lo, hi = index.overlaps(box)
    if index.disjoint:  # the intersections tile the box: local ones from the rank itself, the rest remote
        mine = set(local)
        regions = [tuple(zip(a, b, strict=True)) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]
        return [(region, index.boxes[i] if index.boxes[i] in mine else i) for i, region in zip(ids.tolist(), regions,
                                                                                               strict=True)]
    out: list[tuple[Box, Box | int]] = []
    remaining = [box]
    for cut in local:
        out += [(r, cut) for b in remaining if (r := intersect(b, cut)) is not None]
        remaining = subtract(remaining, cut)
    for i in ids[np.argsort(-(hi - lo).prod(axis=1), kind="stable")].tolist():
        if not remaining:
            break
        source = index.boxes[i]
        out += [(r, i) for b in remaining if (r := intersect(b, source)) is not None]
        remaining = subtract(remaining, source)
    if remaining:
        raise ValueError(f"{name}: region {remaining[0]} of the destination is held by no source rank; the "
                         "source layout does not cover the tensor (a missing pipeline stage or rank?)")
    return out


def plan_tensor(name: str, src: TensorLayout, dst: TensorLayout, load: dict[int, int] | None = None) -> list[Transfer]:
    """Transfers filling every destination box of one tensor. `load` (bytes sent so far per source
    rank) is updated, so that replica choice balances across a whole plan."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{name}: source shape {src.shape} != destination shape {dst.shape}; the two layouts "
                         "describe different models")
    load = {} if load is None else load
    check_destination(name, dst)
    index = _SourceIndex(src)
    item = src.element_size
    cache: dict[tuple, list] = {}
    out = []
    for box, ranks in dst.pieces().items():
        for r in ranks:
            local = tuple(b for b in index.by_rank.get(r, []) if intersect(b, box) is not None)
            key = (box, local)
            if key not in cache:
                cache[key] = [(region, source, box_volume(region) * item)
                              for region, source in _geometry(name, box, local, index)]
            for region, source, nbytes in cache[key]:
                if isinstance(source, tuple):  # a local box of r
                    out.append(Transfer(name, r, r, region, source, box, nbytes))
                    continue
                holders = index.holders[source]
                sender = holders[0] if len(holders) == 1 else min(
                    holders, key=lambda h: (load.get(h, 0), (h - r) % (holders[-1] + 1)))
                load[sender] = load.get(sender, 0) + nbytes
                out.append(Transfer(name, sender, r, region, index.boxes[source], box, nbytes))
    return out


def check_destination(name: str, dst: TensorLayout) -> None:
    for rank, boxes in dst.rank_boxes().items():
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if intersect(a, b) is not None:
                    raise ValueError(f"{name}: destination rank {rank} holds overlapping boxes {a} and {b}; give "
                                     "each rank one box per tensor, or identical ones")


def plan_reshard(src: Layout, dst: Layout) -> list[Transfer]:
    """Every transfer taking `src` to `dst`, tensor by tensor in dst's order (deterministic: every
    rank computes the same plan). Tensors only the source has are ignored."""
    absent = [n for n in dst.tensors if n not in src.tensors]
    if absent:
        raise ValueError(f"the destination needs {len(absent)} tensor(s) the source lacks, e.g. {absent[:3]}; "
                         "load them from a checkpoint or give a source that holds them")
    load: dict[int, int] = {}
    return [t for name in dst.tensors for t in plan_tensor(name, src.tensors[name], dst.tensors[name], load)]


def plan_bytes(plan: list[Transfer]) -> int:
    """Bytes that cross between ranks."""
    return sum(t.nbytes for t in plan if t.remote)


def lower_bound_bytes(src: Layout, dst: Layout) -> int:
    """Σ over destination (rank, box) of the bytes of that box the rank does not already hold."""
    total = 0
    for name, d in dst.tensors.items():
        s = src.tensors[name]
        held = s.rank_boxes()
        for box, ranks in d.pieces().items():
            for r in ranks:
                local = [b for b in held.get(r, []) if intersect(b, box) is not None]
                total += sum(box_volume(m) for m in missing_regions(box, local)) * s.element_size
    return total


def gather_scatter_bytes(src: Layout, dst: Layout, root: int = 0) -> int:
    """The naive baseline: gather each whole tensor on `root`, then send every destination rank its boxes."""
    total = 0
    for name, d in dst.tensors.items():
        s = src.tensors[name]
        on_root = s.rank_boxes().get(root, [])
        whole = tuple((0, n) for n in s.shape)
        total += sum(box_volume(m) for m in missing_regions(whole, on_root)) * s.element_size
        total += sum(box_volume(b) * len([r for r in ranks if r != root])
                     for b, ranks in d.pieces().items()) * s.element_size
    return total
