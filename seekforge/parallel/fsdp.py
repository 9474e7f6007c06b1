"""FSDP2 / HSDP with `fully_shard`, one parameter group per block.

Groups: each Block (main layers), each MTP module, the embedding, and the final norm with the head;
the routed experts of an expert-parallel MoE get their own group on the expert-data-parallel mesh.
The root group is then empty, but its hooks (on `forward` and `hidden`) drive FSDP's lazy init.
MTP modules stay gathered after forward: mtp_losses applies each module's `norm` outside its forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from seekforge.model.moe import MoE


def mixed_precision_policy(name: str) -> MixedPrecisionPolicy:
    """"bf16": bf16 parameters for compute, gradients reduced (and kept) in fp32."""
    if name == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
               expert_mesh: DeviceMesh | None = None, expert_grad_divide_factor: int | None = None) -> None:
    """Shard `model` (a Transformer or a pipeline stage) over `dp_mesh` (1-D: FSDP; 2-D replicate ×
    shard: HSDP). With expert parallelism, experts shard over `expert_mesh` instead; their gradients
    are sums over the whole ep group's tokens, so they divide by the full data-parallel size
    (`expert_grad_divide_factor`) rather than by their own mesh size."""
    for module in model.modules():
        if isinstance(module, MoE) and expert_mesh is not None:
            fully_shard(module.experts, mesh=expert_mesh, mp_policy=mp_policy)
            module.experts.set_gradient_divide_factor(float(expert_grad_divide_factor))
            # A factor other than the shard size makes FSDP reduce-scatter with PREMUL_SUM, which only
            # NCCL has; elsewhere (gloo) reduce with SUM and divide after. Not on a 1-rank shard: FSDP
            # skips that reduce-scatter and divides by the factor itself (forcing SUM would divide twice).
            if expert_mesh.size(expert_mesh.ndim - 1) > 1 and not _has_premul_sum(expert_mesh):
                module.experts.set_force_sum_reduction_for_comms(True)
    layers = getattr(model, "layers", [])
    for block in list(layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)  # the block, or its recompute wrapper
    for mtp_module in getattr(model, "mtp", []):
        # mtp_losses applies `module.norm` after the module's forward: keep its weights gathered.
        fully_shard(mtp_module, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    # The embedding and the head are the largest weights (2·V·H), so each gets its own group rather
    # than staying gathered in the root's. The loss code calls them directly (and MTP calls them
    # again); the head runs last in forward and first in backward, so it is not resharded between.
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and head.weight is embed.weight:  # tie_word_embeddings
        fully_shard([embed, model.norm, head], mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    else:
        if embed is not None:
            fully_shard(embed, mesh=dp_mesh, mp_policy=mp_policy)
        if head is not None:
            fully_shard([model.norm, head], mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    if hasattr(model, "hidden"):
        register_fsdp_forward_method(model, "hidden")


def _has_premul_sum(mesh: DeviceMesh) -> bool:
    """Whether the collectives on `mesh` support ReduceOp.PREMUL_SUM (NCCL's; not gloo's)."""
    return all(dist.get_backend(mesh.get_group(dim)) == "nccl" for dim in range(mesh.ndim))

