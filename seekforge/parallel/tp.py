"""Tensor parallelism with DTensor plans (Megatron-style, as in gpt-fast tp.py and torchtitan).

  MLA       q_b_proj / q_proj and kv_b_proj colwise: each rank owns nh/tp whole heads; o_proj rowwise
            (one all-reduce). The latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms
            stay replicated: they are small, and every head needs the whole latent. The shared RoPE
            key k_pe reaches the heads without a parallel layer in between, so its gradient (a sum
            over heads) is all-reduced explicitly (`_AllReduceRopeKeyGrad`).
  MLP       gate/up colwise, down rowwise; the same for the MoE shared experts.
  embedding vocab-sharded (RowwiseParallel on nn.Embedding: masked lookup + all-reduce).
  lm_head   vocab-sharded logits kept as a DTensor; the loss runs under `loss_context` (loss_parallel),
            so full-vocab logits are never gathered.
Routed experts and the router are not split by TP (each TP rank runs them on the same tokens);
parallel/ep.py splits experts. Sequence parallelism for the norms is not implemented.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from seekforge.model.model import MLP, Block


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a built Transformer (or a pipeline stage holding some of its parts) over `tp_mesh`."""
    tp = tp_mesh.size()
    if getattr(model, "embed_tokens", None) is not None:
        parallelize_module(model.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if getattr(model, "lm_head", None) is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        attn = block.self_attn
        q_proj = "q_proj" if attn.cfg.q_lora_rank is None else "q_b_proj"
        parallelize_module(attn, tp_mesh, {q_proj: ColwiseParallel(), "kv_b_proj": ColwiseParallel(),
                                           "o_proj": RowwiseParallel()})
        attn.num_heads = attn.num_heads // tp  # views in MLA.forward see this rank's heads only
        rope_dim, group = attn.cfg.qk_rope_head_dim, tp_mesh.get_group()
        attn.kv_a_proj_with_mqa.register_forward_hook(
            lambda mod, args, out, rope_dim=rope_dim, group=group: _AllReduceRopeKeyGrad.apply(out, rope_dim, group))
        mlp = block.mlp if isinstance(block.mlp, MLP) else block.mlp.shared_experts
        if mlp is not None:
            _apply_mlp(mlp, tp_mesh)


class _AllReduceRopeKeyGrad(torch.autograd.Function):
    """Identity on kv_a_proj_with_mqa's output [c_kv | k_pe] (..., r + dr). In backward, k_pe's
    gradient holds only this rank's heads' share; sum it over TP ranks. c_kv's gradient is already
    whole (kv_b_proj's colwise input all-reduces it)."""

    @staticmethod
    def forward(ctx, out, rope_dim: int, group):
        ctx.rope_dim, ctx.group = rope_dim, group
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        latent, rope = grad.split([grad.shape[-1] - ctx.rope_dim, ctx.rope_dim], dim=-1)
        rope = rope.contiguous()
        dist.all_reduce(rope, group=ctx.group)
        return torch.cat([latent, rope], dim=-1), None, None


def _apply_mlp(mlp: MLP, tp_mesh: DeviceMesh) -> None:
    parallelize_module(mlp, tp_mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                      "down_proj": RowwiseParallel()})


def loss_context(tp_mesh: DeviceMesh | None):
    """Where the loss and its backward must run: cross-entropy on vocab-sharded logits under TP."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return contextlib.nullcontext()
    return loss_parallel()
