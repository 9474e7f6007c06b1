"""The device meshes for a ParallelConfig.

One 1-D world mesh, unflattened into three views that share it as their root (so FSDP accepts
DTensors from any of them), each with its dimensions outermost first:

    dense   pp × dp_replicate × dp_shard × tp                 non-expert weights: FSDP/HSDP, TP, PP
    experts pp × dp_replicate × dp_shard_mod_ep × ep × tp     expert weights (built when ep > 1)
    batch   pp × dp × tp                                      data slicing and loss averaging
    nodes   pp × dp_replicate × dp_shard_mod_ep × ep_node × ep_local × tp
            the ep dimension split into nodes of consecutive ep ranks (built when ep_nodes > 1):
            mesh["ep_node"] joins the ranks of one local index across nodes (the rails that cross
            node boundaries), mesh["ep_local"] the ranks of one node (parallel/ep.py)
    etp     pp × dp_replicate × dp_shard_mod_etp × etp × ep × tp
            dp_shard_mod_ep split as dp_shard_mod_etp × etp (built when etp > 1): mesh["etp"] joins the
            ranks holding the same experts that split each expert's GEMMs (parallel/ep.py's EtpDispatcher);
            expert weights are DTensors on mesh["etp", "ep"], FSDP-sharded over dp_shard_mod_etp

Expert parallelism borrows its ranks from dp_shard (dp_shard = dp_shard_mod_ep · ep): experts are
split over ranks that see different data, and each expert's weights are FSDP-sharded over the
dp_shard_mod_ep ranks holding the same experts (with dp_replicate: HSDP).

Context parallelism (cp > 1, parallel/cp.py) adds a "cp" dimension just inside tp to the dense and
batch views: dense pp × dp_replicate × dp_shard × cp × tp, batch pp × dp × cp × tp, and a view
pp × dp_replicate × dp_shard_cp × tp whose dp_shard_cp (dp_shard and cp flattened) FSDP shards over,
as torchtitan does: the cp ranks' gradients are reduced with the data-parallel ones. With cp = 1
the views are exactly as above. Expert parallelism then borrows its ranks from dp_shard × cp (ep divides
dp_shard · cp, and dp_shard_mod_ep is dp_shard · cp / ep), as torchtitan does: the all-to-all carries every cp
rank's tokens.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from seekforge.config import ModelConfig, ParallelConfig


class ParallelMesh:
    """The three views, looked up by dimension name: mesh["tp"], mesh["dp"], mesh["ep"],
    mesh["dp_replicate", "dp_shard"]. `dense.mesh` is the rank grid (pp, dp_replicate, dp_shard, tp)."""

    def __init__(self, dense: DeviceMesh, experts: DeviceMesh | None, batch: DeviceMesh,
                 nodes: DeviceMesh | None = None, context: DeviceMesh | None = None, etp: DeviceMesh | None = None):
        self.dense, self.experts, self.batch, self.nodes = dense, experts, batch, nodes
        self.context = context  # with cp > 1: pp × dp_replicate × dp_shard_cp × tp
        self.etp = etp  # with etp > 1: pp × dp_replicate × dp_shard_mod_etp × etp × ep × tp

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        wanted = (names,) if isinstance(names, str) else tuple(names)
        for view in (self.dense, self.experts, self.batch, self.nodes, self.context, self.etp):
            if view is not None and set(wanted) <= set(view.mesh_dim_names):
                return view[names]
        raise KeyError(f"no mesh dimension(s) {wanted}")


def build_mesh(pc: ParallelConfig, model_cfg: ModelConfig, device_type: str | None = None) -> ParallelMesh:
    """Validate the layout against the world size and the model, then build the meshes.

    Call after `dist.init_process_group`. The checks (`ParallelConfig.validate`, which a launcher can
    also call before it spawns ranks) run first, so a bad layout fails on every rank with the same
    ValueError before any group or tensor is allocated.
    """
    if not dist.is_initialized():
        raise ValueError("build_mesh needs torch.distributed initialized: run under torchrun and call "
                         "init_distributed(), or dist.init_process_group yourself")
    world_size = dist.get_world_size()
    pc.validate(world_size, model_cfg)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    world = init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",))
    cp_dim = ((pc.cp,), ("cp",)) if pc.cp > 1 else ((), ())  # context parallelism: just inside tp
    dense = world._unflatten(0, (pc.pp, pc.dp_replicate, pc.dp_shard, *cp_dim[0], pc.tp),
                             ("pp", "dp_replicate", "dp_shard", *cp_dim[1], "tp"))
    experts = None
    if pc.ep > 1:
        experts = world._unflatten(0, (pc.pp, pc.dp_replicate, pc.dp_shard * pc.cp // pc.ep, pc.ep, pc.tp),
                                   ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp"))
    batch = world._unflatten(0, (pc.pp, pc.dp_replicate * pc.dp_shard, *cp_dim[0], pc.tp),
                             ("pp", "dp", *cp_dim[1], "tp"))
    nodes = None
    if pc.ep_nodes > 1:
        nodes = world._unflatten(0, (pc.pp, pc.dp_replicate, pc.dp_shard // pc.ep, pc.ep_nodes, pc.ep // pc.ep_nodes,
                                     pc.tp), ("pp", "dp_replicate", "dp_shard_mod_ep", "ep_node", "ep_local", "tp"))
    context = None
    if pc.cp > 1:
        context = world._unflatten(0, (pc.pp, pc.dp_replicate, pc.dp_shard * pc.cp, pc.tp),
                                   ("pp", "dp_replicate", "dp_shard_cp", "tp"))
    etp = None
    if pc.etp > 1:
        etp = world._unflatten(0, (pc.pp, pc.dp_replicate, pc.dp_shard // (pc.ep * pc.etp), pc.etp, pc.ep, pc.tp),
                               ("pp", "dp_replicate", "dp_shard_mod_etp", "etp", "ep", "tp"))
    return ParallelMesh(dense, experts, batch, nodes, context, etp)


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the job started by torchrun (env:// rendezvous): nccl with one GPU per rank, else gloo.
    timeout_s bounds every collective: a rank that hangs or dies makes the others fail after at most
    that long instead of waiting forever (None: torch's default, 10 min for nccl, 30 min for gloo)."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one key-value store for all restarts and torch prefixes no key by attempt, so a
        # restarted rank can read the address a dead rank of the previous attempt published and fail to
        # connect to it. One prefix per attempt keeps each attempt's rendezvous to itself.
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timeout or datetime.timedelta(minutes=10))
        store = dist.PrefixStore(f"seekforge/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", client)
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
