"""Model build for any size: meta device → parallelize → allocate and fill only this rank's shards.

    modules = build_sharded(cfg, pc, mesh, seed=0)   # this rank's stage(s), parallelized, filled
    reference = build_sharded(cfg, ParallelConfig(), None, seed=0)   # the same weights on one device

Reproducible init without the whole tensor: each parameter's values are drawn in row blocks along
dim 0 (about 2²⁰ elements each), block k from its own generator seeded by blake2b(seed, name, k).
A rank draws only the blocks its box meets and keeps its box's part, so any layout (and one device)
gets bit-identical weights for the same seed, and no rank ever draws a whole 671B model. (This is
not model.Transformer.init_weights' single stream: that one cannot skip ahead.) Rules as there:
ones for norms, zeros for the routing bias, Normal(0, initializer_range) for the rest.
`load_sharded` fills the same shards from an HF or DCP checkpoint instead (parallel/disk.py).

`dry_run(cfg, pc)`: the described layout's per-rank parameter bytes for every rank, plus a meta build
of one rank under a fake process group of pc.world_size ranks, checked against the layout; nothing
is allocated.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from seekforge.config import ModelConfig, ParallelConfig
from seekforge.model.model import build_model
from seekforge.model.moe import MoE
from seekforge.model.rope import RotaryEmbedding, rope_inv_freq
from seekforge.parallel.layout import Box, describe_layout, named_tensors, tensor_placement

BLOCK_ELEMENTS = 2**20


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def init_box(name: str, shape: tuple[int, ...], box: Box, seed: int, std: float) -> torch.Tensor:
    """The values of `box` of parameter `name` (fp32), drawing only the row blocks the box meets."""
    size = [b - a for a, b in box]
    if name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm"):
        return torch.ones(size)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(size)
    rows = max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))  # rows per block
    (first, stop), rest = box[0], tuple(slice(a, b) for a, b in box[1:])
    parts = []
    for k in range(first // rows, math.ceil(stop / rows)):
        lo, hi = k * rows, min((k + 1) * rows, shape[0])
        gen = torch.Generator().manual_seed(block_seed(seed, name, k))
        block = torch.randn((hi - lo, *shape[1:]), generator=gen)  # (rows of block k, *shape[1:])
        parts.append(block[(slice(max(first, lo) - lo, min(stop, hi) - lo), *rest)] * std)
    return torch.cat(parts) if parts else torch.empty(size)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@torch.no_grad()
def materialize(modules: list[nn.Module], cfg: ModelConfig, seed: int | None, device="cpu") -> list[nn.Module]:
    """Allocate this rank's shards of meta-device `modules` on `device` and fill them: reproducibly
    from `seed`, or leave them empty (seed=None) for a checkpoint to fill (`load_sharded`)."""
    for module in modules:
        module.to_empty(device=device)
        for m in module.modules():  # non-persistent buffers: computed, not drawn
            if isinstance(m, RotaryEmbedding):
                m.inv_freq = rope_inv_freq(cfg).to(device)
            if isinstance(m, MoE):
                m.tokens_per_expert = torch.zeros(cfg.n_routed_experts, dtype=torch.long, device=device)
    if seed is not None:
        rank = _rank()
        for name, tensors in named_tensors(modules).items():
            for t in tensors:
                box = dict(tensor_placement(t, rank).boxes(tuple(t.shape)))[rank]
                local = t.to_local() if hasattr(t, "to_local") else t
                local.copy_(init_box(name, tuple(t.shape), box, seed, cfg.initializer_range))
    return modules


def meta_modules(cfg: ModelConfig, pc: ParallelConfig, mesh) -> list[nn.Module]:
    """This rank's part of the model on the meta device, parallelized: the whole model, or its
    pipeline stage(s) cut the way parallel/pp.PipelineRunner cuts them."""
    from seekforge.parallel.parallelize import parallelize
    from seekforge.parallel.pp import parallel_stages

    model = build_model(cfg, device="meta")
    if pc.pp == 1:
        return [parallelize(model, pc, mesh) if mesh is not None else model]
    return parallel_stages(model, pc, mesh)[1]


def build_sharded(cfg: ModelConfig, pc: ParallelConfig, mesh, seed: int = 0, device="cpu") -> list[nn.Module]:
    """This rank's parallelized module(s) with reproducibly initialized shards (see module docstring).
    mesh=None with a one-rank pc: the single-device model, same weights."""
    return materialize(meta_modules(cfg, pc, mesh), cfg, seed, device)


def load_sharded(modules: list[nn.Module], path: str | Path) -> int:
    """Fill materialized (seed=None) modules from a checkpoint: a DCP step directory (every rank
    calls it) or an HF safetensors directory; each rank reads only its slices. Returns bytes read."""
    from seekforge.parallel.disk import read_dcp_shards, read_hf_shards
    from seekforge.parallel.transfer import shards_of

    path = Path(path)
    if (path / ".metadata").exists():
        return read_dcp_shards(path, shards_of(modules))
    if (path / "config.json").exists():
        return read_hf_shards(path, shards_of(modules))
    raise ValueError(f"{path} is neither a DCP checkpoint (.metadata) nor an HF directory (config.json); pass "
                     "a checkpoints/step_* directory or an HF export")


# ---------------------------------------------------------------------------------- dry run
def dry_run(cfg: ModelConfig, pc: ParallelConfig, rank: int = 0) -> str:
    """Per-rank parameter bytes of `pc` for every rank (the described layout), and a meta build of
    `rank` under a fake process group checked against it. Nothing is allocated. Needs no process
    group of its own (refuses to run inside one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from seekforge.parallel.mesh import build_mesh

    if dist.is_initialized():
        raise ValueError("dry_run builds its own fake process group; call it from a plain process, not torchrun")
    pc.validate(pc.world_size, cfg)
    layout = describe_layout(cfg, pc)
    per_rank = layout.rank_bytes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pc.world_size)
    try:
        modules = meta_modules(cfg, pc, build_mesh(pc, cfg, device_type="cpu"))
        held = set()  # (name, box) of every non-empty local tensor the meta build holds
        for name, ts in named_tensors(modules).items():
            for t in ts:
                assert t.is_meta, f"{name} was materialized"
                local = t.to_local() if hasattr(t, "to_local") else t
                box = dict(tensor_placement(t, rank).boxes(tuple(t.shape)))[rank]
                assert tuple(local.shape) == tuple(b - a for a, b in box), (name, local.shape, box)
                if local.numel():
                    held.add((name, box))
        built = sum(math.prod(b - a for a, b in box) * 4 for _, box in held)
        if built != per_rank[rank]:
            raise AssertionError(f"rank {rank}: the meta build holds {built} B, the layout {per_rank[rank]} B")
    finally:
        dist.destroy_process_group()
    model_bytes = sum(math.prod(t.shape) * t.element_size for t in layout.tensors.values())
    return format_rank_bytes(per_rank, pc, rank, model_bytes)


def format_rank_bytes(per_rank: list[int], pc: ParallelConfig, checked: int, model_bytes: int) -> str:
    """Runs of consecutive ranks with equal parameter bytes, one line each; the total against the
    model's own size (`model_bytes`, one copy of every tensor)."""
    lines = [f"layout {pc.world_size} ranks: pp={pc.pp} dp_replicate={pc.dp_replicate} dp_shard={pc.dp_shard} "
             f"tp={pc.tp} ep={pc.ep}; parameter bytes per rank (fp32, described layout):"]
    start = 0
    for r in range(1, len(per_rank) + 1):
        if r == len(per_rank) or per_rank[r] != per_rank[start]:
            span = f"rank {start}" if r - 1 == start else f"ranks {start}-{r - 1}"
            lines.append(f"  {span:<16} {per_rank[start] / 2**30:10.3f} GiB  ({per_rank[start]} B)")
            start = r
    total = sum(per_rank)
    lines.append(f"  total {total / 2**30:.1f} GiB over all ranks, {total / model_bytes:.2f} x the model's "
                 f"{model_bytes / 2**30:.1f} GiB (fp32 parameters, one copy); max {max(per_rank) / 2**30:.3f} GiB")
    if total > model_bytes:  # a user expects the model's size here; say where the rest comes from
        lines.append("  (a tensor is whole on each rank of a mesh dimension that does not split it: routed experts "
                     "and the router on every tp rank, everything on every dp_replicate replica, the embedding "
                     "on the last stage too when MTP needs it)")
    lines.append(f"rank {checked}: meta build parallelized under a fake {pc.world_size}-rank process group; "
                 "its local shapes match the layout; nothing materialized")
    return "\n".join(lines)
