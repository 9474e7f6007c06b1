"""Context parallelism (issue 44): a sequence split over the cp ranks of a group.

The cp ranks see the same batch. Each cuts every row into 2·cp equal chunks and keeps chunk i and
chunk 2·cp−1−i (i its cp rank): under the causal mask an early chunk attends to few keys and a late
one to many, so the pairs give every rank the same attention work. Everything that depends on the
whole row is computed before the cut: the next-token labels, the MTP depths' token-(t+k) ids and
targets (token t+k may sit on another rank), and the global positions (RoPE).

Attention: each rank's queries attend to every key of the row, as ring attention (`ContextParallelAttention`,
`_RingAttention`). MLA's keys and values are expanded from a compressed latent c_kv (r dims) and one shared
RoPE key k_pe (dr dims), so the ring passes those (r + dr per token: 576 for DeepSeek-V3) rather than the
expanded heads (nh·(dn + dr + dv): 40,960). At ring step s a rank holds the latents of rank (rank − s) mod
cp (the next block already in flight, isend/irecv to the neighbours), expands them to this rank's heads
through kv_b_proj (so under TP, its local heads only), attends its two chunks to the visiting two by
global position — a tile whose keys all follow its queries is skipped, a diagonal tile masked within —
and folds each tile into fp32 accumulators by its log-sum-exp (online softmax; bf16 inputs keep the
merge in fp32). Backward is written out: it saves q, this rank's latents, the output and the per-row
LSE; the latents travel the ring again, each block's scores are recomputed and its latent gradient
travels with it, arriving home after cp steps. No rank ever holds the row's expanded keys and values
or a (T/cp, T) score matrix: on a 2,048-token row at cp=4 a rank's activations are 0.03 × one device's
(tests/dist/test_cp_ring.py). `GatheredAttention` (all-gather the latents, one (T/cp, T) mask) is the
simple reference the ring is tested against.

The loss: each rank's cross-entropy means are rescaled to (its kept tokens / all kept tokens of the
cp group), so the cp ranks' losses and gradients sum to the single device's; `all_reduce_grads` sums
the gradients over cp after backward. With FSDP (dp_shard > 1, or mixed_precision="bf16", which
`parallelize` applies through FSDP) the model is sharded over dp_shard × cp (parallel/mesh.py's
dp_shard_cp) and FSDP's reduce-scatter averages over those dp·cp ranks: backward cp · loss then, and no
all_reduce_grads (`grad_scale` and `reduce_grads` pick by whether FSDP shards).

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


class GatheredAttention:
    """The simple reference ring attention is tested against (same interface as ContextParallelAttention):
    all-gather every rank's latents and attend with a (T/cp, T) mask by global positions. It holds the
    whole row's expanded keys and values and the full score matrix per rank, which the ring avoids."""

    def __init__(self, group, q_pos: torch.Tensor):
        self.group = group
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


class ContextParallelAttention:
    """The `attention` object Transformer.hidden passes to every MLA: causal attention of this rank's
    queries over the latents of all cp ranks, as ring attention (_RingAttention). q_pos (T/cp,): this
    rank's global positions, the load-balanced chunks of `shard_positions`."""

    def __init__(self, group, q_pos: torch.Tensor):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        expected = shard_positions(q_pos.numel() * cp, cp, rank)
        if not torch.equal(q_pos.cpu(), expected):
            raise ValueError("ContextParallelAttention needs this rank's load-balanced chunks as q_pos: "
                             f"shard_positions(seq_len, cp={cp}, rank={rank})")
        self.ring = _Ring(group, cp, rank)

    def attend(self, attn, q_nope, q_pe, c_kv, k_pe):
        """q_* (B, T/cp, nh, ·), c_kv (B, T/cp, r), k_pe (B, T/cp, dr) → (B, T/cp, nh·dv)."""
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # (B, nh, T/cp, dqk)
        latents = torch.cat([c_kv, k_pe], dim=-1)  # (B, T/cp, r + dr): what travels the ring
        out = _RingAttention.apply(q, latents, attn.kv_b_proj.weight, attn, self.ring)  # (B, T/cp, nh, dv)
        return out.flatten(2)


class _Ring:
    """Who sends to whom, and which (query chunk, key chunk) tiles the causal mask keeps. At ring step
    s a rank holds the latents of rank (rank − s) mod cp; they arrive from rank − 1 and leave for
    rank + 1. Tile (i, j, causal): this rank's chunk i (0: early, 1: late) against the visiting rank's
    chunk j, under the causal mask within the tile (the diagonal) or not masked at all; pairs whose
    keys all lie after the queries are skipped (half the own block, half of every other)."""

    BLOCK, GRAD = 0, 1  # message tags: cp = 2 sends both kinds to the same neighbour

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self.tiles = []  # per step s
        for s in range(cp):
            mine, theirs = chunk_ids(cp, rank), chunk_ids(cp, (rank - s) % cp)
            self.tiles.append([(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a])

    def shift(self, x: torch.Tensor, tag: int):
        """Post x to rank + 1 and a receive from rank − 1 → (buffer, works to wait on). cp = 1: x itself."""
        if self.cp == 1:
            return x, []
        buffer = torch.empty_like(x)
        works = [dist.isend(x.contiguous(), group=self.group, group_dst=(self.rank + 1) % self.cp, tag=tag),
                 dist.irecv(buffer, group=self.group, group_src=(self.rank - 1) % self.cp, tag=tag)]
        return buffer, works


def _wait(works) -> None:
    for work in works:
        work.wait()


def _expand(attn, latents):
    """latents (B, S, r + dr) → kv (B, S, nh·(dn + dv)), the graph's output for backward, and the per-head
    k (B, nh, S, dqk) and v (B, nh, S, dv). Through attn.kv_b_proj itself, so TP's hooks apply."""
    cfg, nh = attn.cfg, attn.num_heads
    b, s = latents.shape[:2]
    c_kv, k_pe = latents.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv = attn.kv_b_proj(c_kv)
    k_nope, v = kv.view(b, s, nh, cfg.qk_nope_head_dim + cfg.v_head_dim).split(
        [cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, nh, -1)], dim=-1)
    return kv, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def _scores(q, k, causal: bool):
    """q (B, nh, C, dqk) pre-scaled, k (B, nh, C, dqk) → fp32 scores (B, nh, C, C), the diagonal tile masked."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float()
    if causal:
        c = scores.shape[-1]
        scores.masked_fill_(torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores


class _RingAttention(torch.autograd.Function):
    """softmax(q·kᵀ·scale, causal by global position) · v with k, v expanded from the latents of every cp
    rank, which travel the ring: a rank computes on the block it holds while the next one is in flight,
    and merges each tile's partial output into fp32 accumulators by its log-sum-exp (online softmax).
    Saved for backward: q, this rank's latents, the output and the per-row LSE — never the row's
    expanded keys and values nor a (T/cp, T) score matrix. Backward (as FlashAttention-2's, per block):
    the latents travel the ring again, each block is re-expanded and its scores recomputed from the LSE;
    dq accumulates here, and the block's latent gradient travels with it, arriving home after cp steps.

    q (B, nh, T/cp, dqk), latents (B, T/cp, r + dr), weight: attn.kv_b_proj.weight (its gradient) →
    (B, T/cp, nh, dv)."""

    @staticmethod
    def forward(ctx, q, latents, weight, attn, ring):
        q = q * attn.softmax_scale  # scale the (T, dqk) queries rather than the (T, S) scores
        b, nh, t, _ = q.shape
        qs = q.chunk(2, dim=2)  # this rank's two chunks (B, nh, C, dqk)
        out = q.new_zeros(b, nh, t, attn.cfg.v_head_dim, dtype=torch.float32).chunk(2, dim=2)
        lse = q.new_full((b, nh, t), float("-inf"), dtype=torch.float32).chunk(2, dim=2)
        block = latents
        for s in range(ring.cp):
            if s + 1 < ring.cp:
                incoming, works = ring.shift(block, ring.BLOCK)  # the next block flies while this one computes
            _, k, v = _expand(attn, block)
            ks, vs = k.chunk(2, dim=2), v.chunk(2, dim=2)
            for i, j, causal in ring.tiles[s]:
                _merge(_scores(qs[i], ks[j], causal), vs[j], out[i], lse[i])
            if s + 1 < ring.cp:
                _wait(works)
                block = incoming
        out = torch.cat(out, dim=2).transpose(1, 2).to(q.dtype).contiguous()  # (B, T/cp, nh, dv)
        ctx.save_for_backward(q, latents, weight, out, torch.cat(lse, dim=2))
        ctx.attn, ctx.ring = attn, ring
        device = q.device.type  # backward re-expands the blocks under forward's autocast state (as custom_bwd)
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, latents, weight, out, lse = ctx.saved_tensors
        attn, ring = ctx.attn, ctx.ring
        grad_out = grad_out.to(q.dtype)
        delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2)  # (B, nh, T/cp): Σ dO·O per row
        grad_out = grad_out.transpose(1, 2).contiguous()  # (B, nh, T/cp, dv)
        per_chunk = (q.chunk(2, dim=2), grad_out.chunk(2, dim=2), lse.chunk(2, dim=2), delta.chunk(2, dim=2))
        rows = [(qc, go, lc[..., None], dc[..., None]) for qc, go, lc, dc in zip(*per_chunk, strict=True)]
        grad_q = torch.zeros_like(q, dtype=torch.float32).chunk(2, dim=2)
        grad_weight = None
        block, grad_travelling, grad_works = latents, None, None
        for s in range(ring.cp):
            if s + 1 < ring.cp:
                incoming, works = ring.shift(block, ring.BLOCK)
            grad_block, grad_w = _block_backward(attn, weight, block, ring.tiles[s], rows, grad_q,
                                                 ctx.needs_input_grad[2])
            grad_weight = grad_w if grad_weight is None else grad_weight + grad_w
            if grad_travelling is not None:  # the block's gradient from the ranks it visited before
                _wait(grad_works)
                grad_block += grad_travelling
            grad_travelling, grad_works = ring.shift(grad_block, ring.GRAD)
            if s + 1 < ring.cp:
                _wait(works)
                block = incoming
        _wait(grad_works)  # after cp steps this rank's own block's gradient is home
        grad_q = torch.cat(grad_q, dim=2).mul_(attn.softmax_scale).to(q.dtype)
        return grad_q, grad_travelling.to(latents.dtype), grad_weight, None, None


def _merge(scores, v, out, lse) -> None:
    """Fold one tile into the running output: scores (B, nh, C, C) fp32, v (B, nh, C, dv); out (B, nh, C, dv)
    and lse (B, nh, C) fp32, updated in place. Both outputs are normalized, weighted by exp(lse − new lse)."""
    tile_lse = torch.logsumexp(scores, dim=-1)  # finite: no kept tile has a row without keys
    probs = torch.exp(scores - tile_lse[..., None]).to(v.dtype)
    tile_out = torch.matmul(probs, v).float()
    new_lse = torch.logaddexp(lse, tile_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(tile_out.mul_(torch.exp(tile_lse - new_lse)[..., None]))
    lse.copy_(new_lse)


def _block_backward(attn, weight, block, tiles, rows, grad_q, weight_grad: bool):
    """One ring step of backward: re-expand the visiting block (B, S, r + dr), recompute its tiles' probabilities
    from the saved LSE, add their dq into grad_q (fp32, unscaled) and return this rank's share of the block's
    latent gradient (B, S, r + dr) fp32 and of kv_b_proj's weight gradient (None if not wanted)."""
    with torch.enable_grad():
        leaf = block.detach().requires_grad_()
        kv, k, v = _expand(attn, leaf)
    ks, vs = k.detach().chunk(2, dim=2), v.detach().chunk(2, dim=2)
    grad_k = torch.zeros_like(k, dtype=torch.float32).chunk(2, dim=2)  # (B, nh, C, dqk) per key chunk
    grad_v = torch.zeros_like(v, dtype=torch.float32).chunk(2, dim=2)
    for i, j, causal in tiles:
        qc, go, lse, delta = rows[i]
        probs = torch.exp(_scores(qc, ks[j], causal) - lse)  # (B, nh, C, C) fp32, as in forward
        grad_v[j].add_(torch.matmul(probs.to(go.dtype).transpose(-1, -2), go).float())
        grad_scores = probs.mul_(torch.matmul(go, vs[j].transpose(-1, -2)).float().sub_(delta)).to(qc.dtype)
        grad_q[i].add_(torch.matmul(grad_scores, ks[j]).float())
        grad_k[j].add_(torch.matmul(grad_scores.transpose(-1, -2), qc).float())
    dn = attn.cfg.qk_nope_head_dim
    grad_k, grad_v = torch.cat(grad_k, dim=2).transpose(1, 2), torch.cat(grad_v, dim=2).transpose(1, 2)  # (B, S, nh, ·)
    grad_kv = torch.cat([grad_k[..., :dn], grad_v], dim=-1).flatten(2).to(kv.dtype)  # (B, S, nh·(dn + dv))
    inputs = (leaf, weight) if weight_grad else (leaf,)
    grads = torch.autograd.grad(kv, inputs, grad_kv)
    grad_block = grads[0].float()
    grad_block[..., attn.cfg.kv_lora_rank:] += grad_k[..., dn:].sum(2)  # the shared rope key: summed over heads
    return grad_block, grads[1] if weight_grad else None


def cp_lm_loss(model, input_ids, labels, cp_mesh: DeviceMesh, mtp_loss_scale: float = 0.3):
    """lm_loss for one cp rank: input_ids, labels (B, T) are the FULL rows (the same on every cp rank);
    this rank forwards its chunks. Returns (loss, metrics) whose sum over the cp ranks is the
    single-device loss; backward, then `all_reduce_grads`, gives its gradients. Under FSDP over
    dp_shard × cp (also bf16's), backward `cp · loss` instead (FSDP averages over the cp ranks too)."""
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
