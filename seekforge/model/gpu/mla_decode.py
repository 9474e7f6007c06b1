"""Absorbed-MLA decode attention over the paged latent cache (serve/kv_cache.py's pools), for the GPU path.

Each decode row is one query token (a plain decode, or one row of a speculative verify) with its own block
table and context length. In the absorbed form (model.MLA.attend_absorbed) the heads' queries are already
folded into latent space, q_latent (B, nh, r) and q_rope (B, nh, dr), and attend to the cached latents
directly: keys [c_kv | k_pe], values c_kv, shared by every head (a single-head attention whose query rows
are the nh heads).

`mla_decode` is the entry point; `mla_decode_reference` is its torch reference (the gathered context, fp32
softmax), sync-free too. A row with context length 0 (a padding row of a CUDA graph's batch) outputs zeros.

The Triton kernel is split over the context as flash-decoding and FlashMLA are: a decode batch has few rows
and its heads share one latent, so (rows × head blocks) programs alone would leave most SMs idle on a long
context. Kernel 1 runs one program per (row, block of BLOCK_H heads, split of the context): an online softmax
over that split's keys, walking the block table, into fp32 scratch (its normalized partial output and its
log-sum-exp). Kernel 2 merges each (row, head)'s splits weighted by their log-sum-exps. The number of splits
comes from shapes only (the block table's width, the batch, the SM count), never from tensor values, so the
launch never syncs and a CUDA graph can capture it; a split past a row's context runs no iteration and
contributes nothing (log-sum-exp -inf).

Shape legend: B rows, nh heads, r kv_lora_rank, dr qk_rope_head_dim, P pool blocks, L block size,
W block-table width, S splits.
"""

from __future__ import annotations

import functools

import torch

from seekforge.model.gpu import interpreting, triton_ready

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton: triton_ready is False and the kernels never launch
    triton = tl = None

# Tiles as vLLM's Triton MLA decode (decode_attention.py) takes them: 16 heads (tl.dot's least rows; fewer
# heads are padded and masked) × 32 keys per iteration, the whole latent (r = 512) in the accumulator
BLOCK_H = 16
BLOCK_N = 32
MAX_SPLITS = 32
INTERPRETED_SMS = 4  # a stand-in SM count for the split rule when the kernels are interpreted (no device)
COMBINE_TILE = 4096  # elements of (splits × r) that kernel 2 holds at once


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q_latent (B, nh, r), q_rope (B, nh, dr); pools c_kv (P, L, r), k_pe (P, L, dr); block_tables (B, W)
    int (padded with any valid block), context_lens (B,) int → (B, nh, r) in q_latent's dtype: for row b,
    softmax(scale · (q_latent·c_kvᵀ + q_rope·k_peᵀ)) · c_kv over its first context_lens[b] cached tokens.
    The Triton kernels where they can run (triton_ready), else the torch reference."""
    if triton_ready(q_latent):
        return mla_decode_triton(q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, scale)
    return mla_decode_reference(q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, scale)


def mla_decode_reference(q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, scale) -> torch.Tensor:
    b, w = block_tables.shape
    size = c_kv.shape[1]
    keys = c_kv[block_tables].view(b, w * size, -1).float()  # (B, S, r)
    rope_keys = k_pe[block_tables].view(b, w * size, -1).float()  # (B, S, dr)
    scores = (torch.bmm(q_latent.float(), keys.transpose(1, 2))
              + torch.bmm(q_rope.float(), rope_keys.transpose(1, 2))) * scale  # (B, nh, S)
    visible = torch.arange(w * size, device=scores.device) < context_lens[:, None]  # (B, S)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # a row with no context: all -inf → zeros
    return torch.bmm(probs, keys).to(q_latent.dtype)


def mla_decode_triton(q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, scale,
                      num_splits: int | None = None) -> torch.Tensor:
    """`mla_decode` on the Triton kernels (same contract). num_splits: the context's splits, by default
    `split_count`'s choice from the shapes (tests force one)."""
    b, nh, r = q_latent.shape
    dr, size, width = q_rope.shape[2], c_kv.shape[1], block_tables.shape[1]
    if c_kv.shape[2] != r or k_pe.shape[2] != dr or k_pe.shape[:2] != c_kv.shape[:2]:
        raise ValueError(f"mla_decode: pools c_kv {tuple(c_kv.shape)} and k_pe {tuple(k_pe.shape)} do not match "
                         f"q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)}; expected (P, L, r) "
                         f"and (P, L, dr)")
    head_blocks = triton.cdiv(nh, BLOCK_H)
    max_len = width * size
    if num_splits is None:
        num_splits = split_count(b, head_blocks, max_len, q_latent.device)
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), BLOCK_N) * BLOCK_N  # whole iterations per split
    num_splits = max(1, triton.cdiv(max_len, split_len))  # no split that starts past every context
    out_part = torch.empty(b, nh, num_splits, r, dtype=torch.float32, device=q_latent.device)
    lse_part = torch.empty(b, nh, num_splits, dtype=torch.float32, device=q_latent.device)
    r_pad, dr_pad = max(16, triton.next_power_of_2(r)), max(16, triton.next_power_of_2(dr))
    # fp32 pools keep fp32 dots, as the reference computes (Triton's default on a GPU is TF32)
    precision = "ieee" if c_kv.dtype == torch.float32 else "tf32"
    _mla_split_kernel[(b, head_blocks, num_splits)](
        q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, out_part, lse_part,
        scale * 1.4426950408889634, split_len, max_len, nh, r, dr, size,  # scale · log2(e): kernel 1 uses exp2
        *q_latent.stride(), *q_rope.stride(), *c_kv.stride(), *k_pe.stride(), *block_tables.stride(),
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, R_PAD=r_pad, DR_PAD=dr_pad, UPCAST=interpreting(),
        DOT_PRECISION=precision, num_warps=4, num_stages=2)
    out = torch.empty_like(q_latent)
    splits_pad = triton.next_power_of_2(num_splits)
    block_r = min(r_pad, max(16, COMBINE_TILE // splits_pad))
    _mla_combine_kernel[(b, nh, triton.cdiv(r, block_r))](
        out_part, lse_part, out, nh, r, num_splits, *out.stride(), SPLITS_PAD=splits_pad, BLOCK_R=block_r)
    return out


def split_count(batch: int, head_blocks: int, max_len: int, device: torch.device) -> int:
    """How many splits of the context kernel 1 runs, from shapes only: enough programs to fill the SMs twice,
    no more splits than BLOCK_N-key iterations in the block table's span, at most MAX_SPLITS (kernel 2 holds
    them all at once)."""
    want = triton.cdiv(2 * _sm_count(device), batch * head_blocks)
    return max(1, min(want, triton.cdiv(max_len, BLOCK_N), MAX_SPLITS))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


@_jit
def _mla_split_kernel(q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, out_part, lse_part,
                      scale_log2e, split_len, max_len, num_heads, rank, rope_dim, block_size,
                      stride_qb, stride_qh, stride_qr, stride_pb, stride_ph, stride_pd,
                      stride_cp, stride_cl, stride_cr, stride_kp, stride_kl, stride_kd, stride_tb, stride_tw,
                      BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, DR_PAD: tl.constexpr,
                      UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One (row, head block, split): an online softmax over the split's keys → its normalized partial output
    (BLOCK_H, r) and log-sum-exp (in log2 units, scores pre-scaled by log2 e) into out_part (B, nh, S, r)
    and lse_part (B, nh, S). A split with no keys writes lse -inf and zeros."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims, rope_dims = tl.arange(0, R_PAD), tl.arange(0, DR_PAD)
    head_ok, dim_ok, rope_ok = heads < num_heads, dims < rank, rope_dims < rope_dim
    q = tl.load(q_latent + row * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qr,
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_H, R_PAD)
    q_pe = tl.load(q_rope + row * stride_pb + heads[:, None] * stride_ph + rope_dims[None, :] * stride_pd,
                   mask=head_ok[:, None] & rope_ok[None, :], other=0.0)  # (BLOCK_H, DR_PAD)
    if UPCAST:
        q, q_pe = q.to(tl.float32), q_pe.to(tl.float32)
    else:  # tl.dot wants both operands in one dtype: the pool's
        q, q_pe = q.to(c_kv.dtype.element_ty), q_pe.to(k_pe.dtype.element_ty)
    start = split * split_len
    context_len = tl.minimum(tl.load(context_lens + row).to(tl.int32), max_len)  # as the reference: ≤ W·L
    end = tl.minimum(start + split_len, context_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for n in range(start, end, BLOCK_N):  # no iteration when the split starts past the row's context
        pos = n + tl.arange(0, BLOCK_N)
        key_ok = pos < end
        block = tl.load(block_tables + row * stride_tb + (pos // block_size) * stride_tw, mask=key_ok, other=0)
        block, slot = block.to(tl.int64), pos % block_size
        c = tl.load(c_kv + block[:, None] * stride_cp + slot[:, None] * stride_cl + dims[None, :] * stride_cr,
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_N, R_PAD)
        kp = tl.load(k_pe + block[:, None] * stride_kp + slot[:, None] * stride_kl + rope_dims[None, :] * stride_kd,
                     mask=key_ok[:, None] & rope_ok[None, :], other=0.0)  # (BLOCK_N, DR_PAD)
        if UPCAST:
            c, kp = c.to(tl.float32), kp.to(tl.float32)
        scores = tl.dot(q_pe, tl.trans(kp), input_precision=DOT_PRECISION)
        scores = tl.dot(q, tl.trans(c), scores, input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N)
        scores = tl.where(key_ok[None, :], scores * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every iteration has a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    at = (row * num_heads + heads) * num_splits + split  # (BLOCK_H,) into (B, nh, S)
    tl.store(lse_part + at, lse, mask=head_ok)
    tl.store(out_part + at[:, None] * rank + dims[None, :], acc, mask=head_ok[:, None] & dim_ok[None, :])


@_jit
def _mla_combine_kernel(out_part, lse_part, out, num_heads, rank, num_splits, stride_ob, stride_oh, stride_or,
                        SPLITS_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (row, head, BLOCK_R dims): the splits' partial outputs weighted by exp2(lse - max lse) → out in its
    dtype. Splits with lse -inf weigh 0; a row whose splits are all empty (context 0) gets zeros."""
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    split_ok, dim_ok = splits < num_splits, dims < rank
    at = (row * num_heads + head) * num_splits + splits  # (SPLITS_PAD,) into (B, nh, S)
    lse = tl.load(lse_part + at, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all empty: keep exp2(-inf - top) = 0, not nan
    weight = tl.exp2(lse - top)  # (SPLITS_PAD,)
    part = tl.load(out_part + at[:, None] * rank + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :],
                   other=0.0)  # (SPLITS_PAD, BLOCK_R)
    total = tl.sum(weight, 0)
    merged = tl.sum(weight[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + row * stride_ob + head * stride_oh + dims * stride_or, merged.to(out.dtype.element_ty),
             mask=dim_ok)
