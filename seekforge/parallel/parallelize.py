"""`parallelize`: the one place a built model becomes a parallel one, in torchtitan's order.

TP first (it swaps weights for DTensors and must see plain modules), EP next (experts become
DTensors on the ep mesh), then activation recompute (wraps blocks, so it must not hide modules from
TP/EP), then torch.compile per block, and FSDP last (it shards whatever the earlier steps left,
including DTensors, over the data-parallel ranks). Pipeline splitting (parallel/pp.py) happens before
all of this, on the built model; `parallelize` is then applied to each stage.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from seekforge.config import ParallelConfig
from seekforge.model.model import block_slots
from seekforge.model.moe import MoE
from seekforge.parallel.cp import RowCounts
from seekforge.parallel.ep import apply_ep
from seekforge.parallel.fsdp import apply_fsdp, mixed_precision_policy
from seekforge.parallel.recompute import apply_recompute
from seekforge.parallel.tp import apply_tp


def parallelize(model: nn.Module, pc: ParallelConfig, mesh: DeviceMesh) -> nn.Module:
    """Apply pc's TP → EP → recompute → compile → FSDP to `model` in place; returns it."""
    if pc.cp > 1:  # the balance loss's per-row counts span the cp ranks (parallel/cp.py)
        for moe in [m for m in model.modules() if isinstance(m, MoE)]:
            moe.row_counts = RowCounts(mesh["cp"])
    if pc.tp > 1:
        apply_tp(model, mesh["tp"], pc.sequence_parallel)
    if pc.ep > 1:
        apply_ep(model, mesh["ep"], mesh["ep_node", "ep_local"] if pc.ep_nodes > 1 else None,
                 mesh["etp", "ep"] if pc.etp > 1 else None)
    if pc.recompute != "none":
        apply_recompute(model, pc.recompute)
    if pc.compile:
        compile_blocks(model)
    if pc.fsdp:
        hsdp = pc.dp_replicate > 1
        dp_mesh = mesh["dp_replicate", "dp_shard"] if hsdp else mesh["dp_shard"]
        if pc.cp > 1:  # FSDP over dp_shard × cp: it reduces the cp ranks' gradients too (parallel/cp.py)
            dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if hsdp else mesh["dp_shard_cp"]
        expert_mesh = None
        if pc.ep > 1:  # the ranks holding the same expert shard: with expert-TP, the etp ranks hold different ones
            shard = "dp_shard_mod_etp" if pc.etp > 1 else "dp_shard_mod_ep"
            expert_mesh = mesh["dp_replicate", shard] if hsdp else mesh[shard]
        apply_fsdp(model, dp_mesh, mixed_precision_policy(pc.mixed_precision), expert_mesh,
                   expert_grad_divide_factor=pc.dp_replicate * pc.dp_shard * pc.cp)
    return model


def compile_blocks(model: nn.Module) -> nn.Module:
    """torch.compile each block, not the whole model: one graph is traced once and reused for every
    layer of the same shape, a graph break (MoE's data-dependent routing) stays inside one block, and
    FSDP's hooks stay outside the graphs."""
    for container, name in block_slots(model):
        getattr(container, name).compile()
    return model
