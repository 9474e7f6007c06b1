"""Context parallelism (issue 44, first step): a sequence split over the cp ranks of a group.

The cp ranks see the same batch. Each cuts every row into 2·cp equal chunks and keeps chunk i and
chunk 2·cp−1−i (i its cp rank): under the causal mask an early chunk attends to few keys and a late
one to many, so the pairs give every rank the same attention work. Everything that depends on the
whole row is computed before the cut: the next-token labels, the MTP depths' token-(t+k) ids and
targets (token t+k may sit on another rank), and the global positions (RoPE).

Attention: each rank's queries attend to every key of the row. MLA's keys and values are expanded
from a compressed latent c_kv (r dims) and one shared RoPE key k_pe (dr dims), so the ranks exchange
those (r + dr per token) rather than the expanded heads (nh·(dn + dr + dv) per token):
`ContextParallelAttention` all-gathers them (autograd-aware: the gradient is summed back to the rank
that owns the token) and masks by global positions. A ring that overlaps the exchange with the
per-block attention (online-softmax merging) is the better version, not written yet.

The loss: each rank's cross-entropy means are rescaled to (its kept tokens / all kept tokens of the
cp group), so the cp ranks' losses and gradients sum to the single device's; `all_reduce_grads` sums
the gradients over cp after backward. With FSDP (dp_shard > 1) the model is sharded over dp_shard × cp
(parallel/mesh.py's dp_shard_cp) and FSDP's reduce-scatter averages over those dp·cp ranks: backward
cp · loss then, and no all_reduce_grads (`grad_scale` and `reduce_grads` pick by whether FSDP shards).

With the other dimensions: TP splits each cp rank's heads (the latents stay whole, so the exchange is the
same); a pipeline's stages forward their cp rank's chunks and the last stage scores its share through
`shard_batch` and `share_of_mean` (parallel/pp.py); EP borrows its ranks from dp_shard × cp, so the
all-to-all carries every cp rank's tokens; the expert loads of the aux-loss-free bias are summed over
dp × cp (`data_group`). The weights are replicated over cp or FSDP-sharded over dp_shard × cp, which
parallel/layout.py describes, so checkpoints move between cp and other layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from seekforge.model.dtensor import local_tensor
from seekforge.model.loss import IGNORE_INDEX, mtp_shifted, objective


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2·cp chunks rank `rank` holds: one early, one late (even causal work)."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """x (..., T, ...) → this rank's load-balanced chunks (..., T/cp, ...) along `dim`; T % (2·cp) == 0."""
    t = x.shape[dim]
    if t % (2 * cp):
        raise ValueError(f"context parallelism cp={cp} splits rows into {2 * cp} equal chunks, but the sequence "
                         f"length is {t}; use a length divisible by {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim=dim)


def shard_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions (T/cp,) of this rank's tokens: RoPE and the causal mask use these."""
    return shard_sequence(torch.arange(seq_len, device=device)[None], cp, rank)[0]


class _GatherSequence(torch.autograd.Function):
    """All-gather (B, T/cp, D) along T over `group` → (B, T, D) in rank order; the backward sums
    every rank's gradient and keeps this rank's slice (a reduce-scatter, written as all-reduce + slice:
    gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.len = group, dist.get_rank(group), x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.rank * ctx.len:(ctx.rank + 1) * ctx.len], None


class ContextParallelAttention:
    """The `attention` object Transformer.hidden passes to every MLA: causal attention of this rank's
    queries over the latents of all cp ranks. q_pos (T/cp,): this rank's global positions."""

    def __init__(self, group, q_pos: torch.Tensor):
        self.group, self.q_pos = group, q_pos
        cp = dist.get_world_size(group)
        seq_len = q_pos.numel() * cp
        gathered = torch.cat([shard_positions(seq_len, cp, r, q_pos.device) for r in range(cp)])
        self.order = gathered.argsort()  # gathered latents → global order (the single device's sums)
        self.mask = (q_pos[:, None] >= torch.arange(seq_len, device=q_pos.device))[None, None]  # (1, 1, T/cp, T)

    def attend(self, attn, q_nope, q_pe, c_kv, k_pe):
        """q_* (B, T/cp, nh, ·), c_kv (B, T/cp, r), k_pe (B, T/cp, dr) → (B, T/cp, nh·dv)."""
        r = c_kv.shape[-1]
        latents = _GatherSequence.apply(torch.cat([c_kv, k_pe], dim=-1), self.group)[:, self.order]  # (B, T, r+dr)
        return attn.attend_naive(q_nope, q_pe, latents[..., :r], latents[..., r:], mask=self.mask)


def cp_lm_loss(model, input_ids, labels, cp_mesh: DeviceMesh, mtp_loss_scale: float = 0.3):
    """lm_loss for one cp rank: input_ids, labels (B, T) are the FULL rows (the same on every cp rank);
    this rank forwards its chunks. Returns (loss, metrics) whose sum over the cp ranks is the
    single-device loss; backward, then `all_reduce_grads`, gives its gradients. Under FSDP over
    dp_shard × cp, backward `cp · loss` instead (FSDP averages over the cp ranks too)."""
    depths = model.cfg.num_nextn_predict_layers if mtp_loss_scale > 0 else 0
    local_ids, local_labels, shifted = shard_batch(input_ids, labels, cp_mesh, depths)
    positions = shard_positions(input_ids.shape[1], cp_mesh.size(), cp_mesh.get_local_rank(), input_ids.device)
    attention = ContextParallelAttention(cp_mesh.get_group(), positions)
    h, rope, mask = model.hidden(local_ids, positions, attention=attention)
    return objective(model, h, local_ids, local_labels, rope, mask, None, mtp_loss_scale, shifted or None,
                     share_of_mean(cp_mesh.get_group()))


def shard_batch(input_ids, labels, cp_mesh: DeviceMesh, depths: int):
    """Full rows (B, T) → this rank's ids and labels (B, T/cp) and, per MTP depth, the (token t+k ids, targets)
    pairs computed on the full rows first (token t+k may sit on another rank), then cut the same way."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    shifted = [tuple(shard_sequence(t, cp, rank) for t in mtp_shifted(input_ids, labels, k))
               for k in range(1, depths + 1)]
    return shard_sequence(input_ids, cp, rank), shard_sequence(labels, cp, rank), shifted


def share_of_mean(group):
    """objective's `reduce`: this rank's mean (over its kept targets) → its share of the mean over all the cp
    ranks' kept targets, so the shares sum to the single device's mean."""
    def reduce(loss, targets):
        kept = (targets != IGNORE_INDEX).sum()
        total = kept.clone()
        dist.all_reduce(total, group=group)
        return loss * (kept / total)

    return reduce


def all_reduce_grads(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Sum every parameter's gradient over the cp ranks (each holds its tokens' share)."""
    group = cp_mesh.get_group()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(local_tensor(p.grad), group=group)  # under TP: this rank's shard, summed over cp


class RowCounts:
    """An MoE layer's `row_counts` under cp (parallel/parallelize.py sets it): the sequence-wise balance
    loss's per-row expert counts (B, E) summed over the cp ranks, which hold the rows' other chunks."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.group, self.parts = cp_mesh.get_group(), cp_mesh.size()

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(counts, group=self.group)
        return counts


def grad_scale(module: nn.Module, cp_mesh: DeviceMesh) -> int:
    """What a cp rank multiplies its loss share by before backward: FSDP over dp_shard × cp (a module it
    shards) averages the gradients over the cp ranks too, so cp; without FSDP `reduce_grads` sums them, so 1."""
    return cp_mesh.size() if isinstance(module, FSDPModule) else 1


def reduce_grads(modules: list[nn.Module], cp_mesh: DeviceMesh) -> None:
    """After the backward passes of an optimizer step: sum the gradients over the cp ranks where FSDP did not."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            all_reduce_grads(module, cp_mesh)


def data_group(mesh):
    """The process group over which ranks see different tokens (of one tp and pp coordinate): the data-parallel
    ranks, and with cp > 1 their cp ranks too (expert loads are summed over it: train/balance.py)."""
    if "cp" not in mesh.batch.mesh_dim_names:
        return mesh["dp"].get_group()
    return mesh.batch["dp", "cp"]._flatten("dp_cp").get_group()
