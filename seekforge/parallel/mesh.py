"""The device mesh for a ParallelConfig.

Mesh dimensions, outermost first: pp, dp_replicate, dp_shard_mod_ep, ep, tp. Expert parallelism
borrows its ranks from dp_shard (dp_shard = dp_shard_mod_ep · ep), so experts are split over ranks that
see different data, and every expert's weights are FSDP-sharded over the dp_shard_mod_ep ranks that
hold the same experts (with dp_replicate: HSDP). Two flattened views name the other groups:

    dp_shard = dp_shard_mod_ep × ep           FSDP of non-expert weights (with dp_replicate: HSDP)
    dp       = dp_replicate × dp_shard        data loading and loss averaging
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from seekforge.config import ModelConfig, ParallelConfig

DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")


class ParallelMesh:
    """The world DeviceMesh plus its flattened views, looked up by name: mesh["tp"], mesh["dp"],
    mesh["dp_replicate", "dp_shard"]. Flattened views are kept here because torch wants them
    bookkept rather than re-sliced from the root."""

    def __init__(self, world: DeviceMesh, flattened: dict[str, DeviceMesh]):
        self.world, self.flattened = world, flattened

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flattened:
            return self.flattened[names]
        return self.world[names]


def build_mesh(pc: ParallelConfig, model_cfg: ModelConfig, device_type: str | None = None) -> ParallelMesh:
    """Validate the layout against the world size and the model, then build the mesh.

    Call after `dist.init_process_group`. The checks (`ParallelConfig.validate`, which a launcher can
    also call before it spawns ranks) run first, so a bad layout fails on every rank with the same
    ValueError before any group or tensor is allocated.
    """
    if not dist.is_initialized():
        raise ValueError("build_mesh needs torch.distributed initialized: run under torchrun and call "
                         "init_distributed(), or dist.init_process_group yourself")
    pc.validate(dist.get_world_size(), model_cfg)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    shape = (pc.pp, pc.dp_replicate, pc.dp_shard // pc.ep, pc.ep, pc.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    return ParallelMesh(world, {
        "dp_shard": world["dp_shard_mod_ep", "ep"]._flatten("dp_shard"),
        "dp": world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp"),
    })


def init_distributed(backend: str | None = None) -> None:
    """Join the job started by torchrun (env:// rendezvous): nccl with one GPU per rank, else gloo."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
