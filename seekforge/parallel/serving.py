"""Serving layouts applied to a Transformer: attention tensor- or data-parallel, MoE expert-parallel.

The engine's layout is `describe_engine_layout(cfg, tp, dp_attention, ep)` (layout.py) over
world = dp_attention · tp ranks, row-major: rank = dp_rank · tp + tp_rank.

  attention TP   within each of the dp_attention replicas (tp ranks, one TP group): q_b_proj (q_proj)
                 and kv_b_proj keep this rank's nh/tp heads' rows, o_proj their columns and its output
                 is all-reduced (vLLM's ColumnParallelLinear / RowParallelLinear). MLA's latent c_kv and
                 rope key k_pe are shared by all heads, so every TP rank computes and caches the whole
                 latent (vLLM and SGLang do the same for MLA): TP splits attention compute and weights,
                 not the KV cache. Dense MLPs and shared experts: gate/up rows, down columns +
                 all-reduce. Embedding: vocab rows, masked lookup + all-reduce; lm_head: vocab rows,
                 logits all-gathered.
  attention DP   dp_attention > 1: each replica serves its own requests with its own scheduler and
                 latent cache (serve/distributed.py); its weights are those of a tp-rank engine.
  MoE EP         routed experts split over consecutive groups of `ep` ranks (replicated over the
                 world/ep groups); token copies reach them through parallel/ep.py's all-to-all
                 dispatcher. Under TP the replica's TP ranks hold the same tokens, so each routes
                 only its chunk of them and the results are all-gathered (TokenSplitDispatcher).
                 Every rank of an EP group must run each MoE layer the same number of times per
                 step: a replica with no work runs a dummy one-token forward (SGLang's idle batch).

Weights are plain local tensors (no DTensor in the serving hot loop); `engine_shards` names each
with its global box, so the disk executor (parallel/disk.py) reads exactly this rank's slices of an
HF checkpoint and the in-memory executor (parallel/transfer.py) syncs trainer weights into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from seekforge.config import ModelConfig
from seekforge.model.model import MLA, Transformer, block_slots, build_model
from seekforge.model.moe import MLP, MoE
from seekforge.parallel.ep import AllToAllDispatcher
from seekforge.parallel.layout import Box, Layout, chunk, describe_engine_layout, named_tensors
from seekforge.parallel.transfer import Shards


def check_engine_layout(cfg: ModelConfig, tp: int, dp_attention: int, ep: int, world_size: int) -> None:
    """Refuse a serving layout that cannot work, before anything is built: the message names the fix."""
    for name, value in (("tp", tp), ("dp_attention", dp_attention), ("ep", ep)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value}: give a positive integer")
    world = tp * dp_attention
    if world != world_size:
        raise ValueError(f"--tp {tp} x --dp-attention {dp_attention} = {world} ranks, but the job has "
                         f"world size {world_size}; launch with `torchrun --nproc-per-node {world} -m seekforge "
                         f"serve ...` or pick --tp/--dp-attention whose product is {world_size}")
    nh = cfg.num_attention_heads
    if nh % tp:
        divisors = [d for d in range(1, nh + 1) if nh % d == 0]
        raise ValueError(f"--tp {tp} does not divide num_attention_heads={nh}; pick tp in {divisors}")
    if ep > 1:
        experts = cfg.n_routed_experts
        if not experts or not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            raise ValueError(f"--ep {ep}: the model has no routed experts to split; use --ep 1")
        if experts % ep:
            raise ValueError(f"--ep {ep} does not divide n_routed_experts={experts}; pick ep among "
                             f"{[d for d in range(1, experts + 1) if experts % d == 0 and world % d == 0]}")
        if world % ep:
            raise ValueError(f"--ep {ep} does not divide the {world} serving ranks (tp x dp_attention); pick ep "
                             f"among {[d for d in range(1, world + 1) if world % d == 0]}")


@dataclass
class EngineGroups:
    """This rank's place in a serving layout and the process groups it talks over (None: size 1)."""

    tp: int
    dp_attention: int
    ep: int
    rank: int
    tp_group: object | None
    ep_group: object | None

    @property
    def world_size(self) -> int:
        return self.tp * self.dp_attention

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def leader(self) -> int:
        """The global rank that schedules this rank's replica (its TP rank 0)."""
        return self.dp_rank * self.tp

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def engine_groups(tp: int, dp_attention: int, ep: int) -> EngineGroups:
    """Every rank calls this in the same order (dist.new_group is collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group = ep_group = None
    if tp > 1:
        for d in range(dp_attention):
            group = dist.new_group(list(range(d * tp, (d + 1) * tp)))
            if rank // tp == d:
                tp_group = group
    if ep > 1:
        for e in range(world // ep):
            group = dist.new_group(list(range(e * ep, (e + 1) * ep)))
            if rank // ep == e:
                ep_group = group
    return EngineGroups(tp, dp_attention, ep, rank, tp_group, ep_group)


# ---------------------------------------------------------------------------------- collectives
def _all_reduce_output(module: nn.Linear, args, out: torch.Tensor) -> torch.Tensor:
    """Row-parallel output: each rank holds a partial sum over its input columns. A bias is whole on
    every rank, so it is taken out before the sum and added once after."""
    if module.bias is not None:
        out = out - module.bias
    dist.all_reduce(out, group=module.tp_group)
    return out if module.bias is None else out + module.bias


def _gather_vocab(module: nn.Linear, args, out: torch.Tensor) -> torch.Tensor:
    """(..., V/tp) vocab-sharded logits → (..., V). Shards follow DTensor's chunk rule (⌈V/tp⌉ rows, the
    last ones short), so each is padded to ⌈V/tp⌉ for the all-gather and trimmed after."""
    size, vocab = module.shard_size, module.vocab_size
    padded = F.pad(out, (0, size - out.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(module.tp)]
    dist.all_gather(parts, padded, group=module.tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab]


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + len(weight)) of the embedding on this rank: ids outside look up zeros, and
    the all-reduce over the TP group gives every rank the full embedding (Megatron's VocabParallel)."""

    def __init__(self, weight: nn.Parameter, start: int, tp_group):
        super().__init__()
        self.weight, self.start, self.tp_group = weight, start, tp_group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        dist.all_reduce(out, group=self.tp_group)
        return out


# ---------------------------------------------------------------------------------- sharding
def _rank_box(layout: Layout, name: str, rank: int) -> Box:
    boxes = layout.tensors[name].rank_boxes().get(rank)
    assert boxes and len(boxes) == 1, (name, boxes)
    return boxes[0]


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    else:
        module._buffers[attr] = value


@torch.no_grad()
def shard_for_serving(model: Transformer, layout: Layout, groups: EngineGroups) -> Transformer:
    """Keep this rank's boxes of `layout` (the model may be on the meta device) and install the
    collectives of the layout (module docstring). With one rank the model is returned untouched."""
    if groups.world_size == 1:
        return model
    cfg, rank = model.cfg, groups.rank
    for name, tensors in named_tensors(model).items():
        box = _rank_box(layout, name, rank)
        full = tensors[0]
        if tuple(b - a for a, b in box) != tuple(full.shape):
            _set_tensor(model, name, full.detach()[tuple(slice(a, b) for a, b in box)].clone())
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if groups.tp > 1:
        _apply_tensor_parallel(model, layout, groups)
    if groups.ep > 1:
        for moe in model.moe_layers():
            moe.dispatcher = AllToAllDispatcher(groups.ep_group, cfg.n_routed_experts)
            if groups.tp > 1:
                moe.dispatcher = TokenSplitDispatcher(moe.dispatcher, groups)
    return model


class TokenSplitDispatcher:
    """TP + EP: the TP ranks of a replica hold the same tokens. Each routes only its chunk of them
    (DTensor's chunk rule over tp) through the EP all-to-all, so no expert computes a token twice and
    the exchange carries each copy once; the combined rows are then all-gathered over the TP group
    (padded to the largest chunk). The shared experts are not affected: MoE.forward runs them, TP-split,
    on all the tokens."""

    def __init__(self, inner: AllToAllDispatcher, groups: EngineGroups):
        self.inner, self.tp, self.tp_rank, self.tp_group = inner, groups.tp, groups.tp_rank, groups.tp_group

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, num_experts: int):
        """x (N, H), indices (N, K) → this rank's chunk dispatched (possibly empty)."""
        lo, hi = chunk(0, x.shape[0], self.tp, self.tp_rank)
        routed, counts, state = self.inner.dispatch(x[lo:hi], indices[lo:hi], num_experts)
        return routed, counts, (state, x.shape[0])

    def wait(self, routed: torch.Tensor, state) -> torch.Tensor:
        return self.inner.wait(routed, state[0])

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor) -> torch.Tensor:
        """→ (N, H): every TP rank's chunk of the combined output, in token order."""
        inner_state, n = state
        bounds = [chunk(0, n, self.tp, r) for r in range(self.tp)]
        lo, hi = bounds[self.tp_rank]
        mine = self.inner.combine(y, inner_state, weights[lo:hi])  # (hi - lo, H)
        size = max(b - a for a, b in bounds)
        padded = F.pad(mine, (0, 0, 0, size - (hi - lo))).contiguous()  # (⌈N/tp⌉, H)
        parts = [torch.empty_like(padded) for _ in range(self.tp)]
        dist.all_gather(parts, padded, group=self.tp_group)
        return torch.cat([part[:b - a] for part, (a, b) in zip(parts, bounds, strict=True)])


def _apply_tensor_parallel(model: Transformer, layout: Layout, groups: EngineGroups) -> None:
    tp, group = groups.tp, groups.tp_group

    def row_parallel(linear: nn.Linear) -> None:
        linear.tp_group = group
        linear.register_forward_hook(_all_reduce_output)

    for container, name in block_slots(model):
        block = getattr(container, name)
        attn: MLA = block.self_attn
        attn.num_heads //= tp  # the views in MLA see this rank's heads only
        row_parallel(attn.o_proj)
        mlp = block.mlp
        if isinstance(mlp, MLP):
            row_parallel(mlp.down_proj)
        elif isinstance(mlp, MoE) and mlp.shared_experts is not None:
            row_parallel(mlp.shared_experts.down_proj)
    vocab = model.cfg.vocab_size
    (start, _), _ = _rank_box(layout, "embed_tokens.weight", groups.rank)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, start, group)
    head = model.lm_head
    head.tp_group, head.tp, head.vocab_size, head.shard_size = group, tp, vocab, math.ceil(vocab / tp)
    head.register_forward_hook(_gather_vocab)


def engine_shards(model: nn.Module, layout: Layout, rank: int) -> Shards:
    """This rank's tensors of a sharded engine model by full-model name with their global boxes: the
    destination for parallel/disk.py's readers and parallel/transfer.py's sync_shards."""
    out: Shards = {}
    for name, tensors in named_tensors(model).items():
        box = _rank_box(layout, name, rank)
        for t in tensors:
            assert tuple(t.shape) == tuple(b - a for a, b in box), (name, tuple(t.shape), box)
            out.setdefault(name, []).append((box, t.data))
    return out


def build_engine_model(cfg: ModelConfig, groups: EngineGroups, dtype: torch.dtype = torch.float32,
                       device="cpu") -> tuple[Transformer, Layout]:
    """This rank's sharded engine model with uninitialized weights (fill them with `fill_from_state_dict`,
    parallel/disk.py's read_hf_shards on `engine_shards`, or sync_shards), and the engine layout. Only
    this rank's shards are ever allocated."""
    layout = describe_engine_layout(cfg, groups.tp, groups.dp_attention, groups.ep, dtype)
    model = build_model(cfg, device="meta").cast(dtype)
    shard_for_serving(model, layout, groups)
    model.to_empty(device=device)
    return model.init_buffers().eval(), layout


@torch.no_grad()
def fill_from_state_dict(shards: Shards, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy each shard's box out of full tensors (a preset built whole on every rank, or a test)."""
    for name, pieces in shards.items():
        for box, local in pieces:
            local.copy_(state_dict[name][tuple(slice(a, b) for a, b in box)])
