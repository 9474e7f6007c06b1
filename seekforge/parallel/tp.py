"""Tensor parallelism with DTensor plans (Megatron-style, as in gpt-fast tp.py and torchtitan).

  MLA       q_b_proj / q_proj and kv_b_proj colwise: each rank owns nh/tp whole heads; o_proj rowwise.
            The latent projections (q_a_proj, kv_a_proj_with_mqa) and their norms stay replicated:
            they are small, and every head needs the whole latent. The shared RoPE key k_pe reaches
            the heads without a parallel layer in between, so its gradient (a sum over heads) is
            all-reduced explicitly (`_AllReduceRopeKeyGrad`).
  MLP       gate/up colwise, down rowwise; the same for the MoE shared experts.
  embedding vocab-sharded (RowwiseParallel on nn.Embedding: masked lookup + all-reduce).
  lm_head   vocab-sharded logits kept as a DTensor; the loss runs under `loss_context` (loss_parallel),
            so full-vocab logits are never gathered.
Routed experts and the router are not split by TP (each TP rank runs them on the same tokens);
parallel/ep.py splits experts.

Sequence parallel (Megatron-LM SP, arXiv:2205.05198): between the attention and MLP regions the
residual stream stays split along the sequence, (B, T/tp, H) per rank, so the norms (and MTP's
per-token eh_proj) run on 1/tp of the tokens; each region all-gathers its input and its output
projection reduce-scatters instead of all-reducing. MoE layers gather their input and slice their
output (their routed experts see every token of the sequence on every TP rank).
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
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from seekforge.model.model import Block
from seekforge.model.moe import MLP


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard a built Transformer (or a pipeline stage holding some of its parts) over `tp_mesh`."""
    tp, sp = tp_mesh.size(), sequence_parallel
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between regions
    if getattr(model, "embed_tokens", None) is not None:
        parallelize_module(model.embed_tokens, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=residual))
    if getattr(model, "lm_head", None) is not None:
        parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1),
                                                                   use_local_output=False))
    if sp:
        per_token = [m for name, m in model.named_modules() if name.split(".")[-1] in
                     ("norm", "input_layernorm", "post_attention_layernorm", "enorm", "hnorm", "eh_proj")]
        for module in per_token:
            parallelize_module(module, tp_mesh, SequenceParallel(use_local_output=True))
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        attn = block.self_attn
        q_proj = "q_proj" if attn.cfg.q_lora_rank is None else "q_b_proj"
        parallelize_module(attn, tp_mesh, {q_proj: ColwiseParallel(), "kv_b_proj": ColwiseParallel(),
                                           "o_proj": RowwiseParallel(output_layouts=residual)})
        attn.num_heads = attn.num_heads // tp  # views in MLA.forward see this rank's heads only
        rope_dim, group = attn.cfg.qk_rope_head_dim, tp_mesh.get_group()
        attn.kv_a_proj_with_mqa.register_forward_hook(
            lambda mod, args, out, rope_dim=rope_dim, group=group: _AllReduceRopeKeyGrad.apply(out, rope_dim, group))
        if sp:  # gather the sequence for attention: args (x, cos, sin, mask, kv_cache), only x is split
            parallelize_module(attn, tp_mesh, PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None), use_local_output=True))
        if isinstance(block.mlp, MLP):
            _apply_mlp(block.mlp, tp_mesh, output=residual)
            if sp:
                parallelize_module(block.mlp, tp_mesh, PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
        else:
            if block.mlp.shared_experts is not None:
                _apply_mlp(block.mlp.shared_experts, tp_mesh, output=Replicate())
            if sp:
                parallelize_module(block.mlp, tp_mesh, PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True))


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


def _apply_mlp(mlp: MLP, tp_mesh: DeviceMesh, output) -> None:
    parallelize_module(mlp, tp_mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                      "down_proj": RowwiseParallel(output_layouts=output)})


def loss_context(tp_mesh: DeviceMesh | None):
    """Where the loss and its backward must run: cross-entropy on vocab-sharded logits under TP."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return contextlib.nullcontext()
    return loss_parallel()
