"""The DeepSeek-V3 architecture, single-device math (no collectives; see parallel/ for those).

Shape legend: B batch, T query tokens, S key tokens, H hidden, nh heads,
dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, r = kv_lora_rank, V vocab.

Parameter names follow the Hugging Face checkpoint (`model.layers.N.self_attn.q_a_proj` ↔
`layers.N.self_attn.q_a_proj`), so model/hf.py is a thin renaming layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seekforge.config import ModelConfig
from seekforge.model import kernels
from seekforge.model.gpu import gpu_path
from seekforge.model.kernels import Linear
from seekforge.model.moe import MLP, MoE
from seekforge.model.precision import matmul_dtype, onednn_size, uses_onednn
from seekforge.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq, softmax_scale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # Nothing to round between normalizing and scaling (the fp32 residual stream under bf16
            # autocast). On CPU F.rms_norm is a composite of five ops with autograd's backward for each; on
            # the GPU path it is one fused kernel each way.
            if x.device.type == "cpu" and not gpu_path(x) and type(x) is torch.Tensor \
                    and not torch.compiler.is_compiling():
                if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
                    return _RMSNorm.apply(x, self.weight, self.eps)
                if x.numel() >= 16 * x.shape[-1]:  # fewer rows: F.rms_norm's one call has the smaller fixed cost
                    return torch.mul(x, _rstd(x, self.eps)).mul_(self.weight)  # serving: no Function to enter
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalize in fp32, round to the input dtype, then scale (HF's order, so bf16 results match);
        # F.rms_norm is one fused kernel instead of five.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x²) + eps) over the last dim, (..., 1), from one fused norm pass."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()


class _RMSNorm(torch.autograd.Function):
    """fp32 x · rsqrt(mean(x²) + eps) · w for CPU, as F.rms_norm computes it (≤ 2e-6 apart: the mean
    square comes from one fused norm pass), faster forward + backward at training sizes than F.rms_norm's
    five ops with a backward each (the A/B is in this file's git history); saves x and the (N, 1) rstd only. Its
    forward math alone serves inference, where it is faster from 16 rows."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = _rstd(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x * rstd
        grad_w = (grad * normed).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad * weight
            dot = (grad_normed * normed).mean(dim=-1, keepdim=True)
            grad_x = grad_normed.sub_(normed.mul_(dot)).mul_(rstd)
        return grad_x, grad_w, None


# ---------------------------------------------------------------------------------------- MLA
SCORES_CHUNK_BYTES = 64 << 20  # absorbed attention's fp32 scores at most this big at a time (sequences per chunk)


class MLA(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2 §2.1).

    Keys and values come from a compressed latent c_kv (r dims, RMS-normed) plus one shared RoPE key
    k_pe (dr dims); only these two are cached for decoding. Two equal paths:
      naive    — expand c_kv through kv_b_proj into per-head k_nope, v, then ordinary attention;
      absorbed — fold kv_b_proj's key half into q and its value half into the output, so attention
                 runs directly against the cached latents (cheap per decoded token).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(nh * cfg.v_head_dim, h, bias=cfg.attention_bias)
        self.softmax_scale = softmax_scale(cfg)

    # -- projections shared by both paths ----------------------------------------------------
    def project_q(self, x, cos, sin):
        """x (B, T, H) → q_nope (B, T, nh, dn), q_pe (B, T, nh, dr) with RoPE applied."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:-1], self.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_pe, cos, sin, cfg.rope_interleave)

    def project_latent(self, x, cos, sin):
        """x (B, T, H) → c_kv (B, T, r) normed, k_pe (B, T, dr) with RoPE: what the cache stores."""
        cfg = self.cfg
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c_kv), apply_rope(k_pe, cos, sin, cfg.rope_interleave)

    def kv_b_weights(self, weight=None):
        """kv_b_proj's weight (or `weight`, e.g. one with a LoRA merged in) split per head: w_uk (nh, dn, r),
        w_uv (nh, dv, r)."""
        cfg = self.cfg
        w = self.kv_b_proj.weight if weight is None else weight
        w = w.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)

    # -- attention over latents ---------------------------------------------------------------
    def attend_naive(self, q_nope, q_pe, c_kv, k_pe, mask=None, is_causal=False, kv_b_weight=None, fused=False):
        """q_* (B, T, nh, ·), c_kv (B, S, r), k_pe (B, S, dr); mask (B|1, 1|nh, T, S) bool, True = keep,
        or the DocumentLayout of packed documents (then T = S); kv_b_weight: used instead of kv_b_proj's
        (serving merges a LoRA into it); fused: inference without autograd, on PyTorch's fused attention
        kernel also on a CPU (see _attention). Returns (B, T, nh·dv)."""
        cfg = self.cfg
        b, s = c_kv.shape[:2]
        kv = self.kv_b_proj(c_kv) if kv_b_weight is None else F.linear(c_kv, kv_b_weight)
        kv = kv.view(b, s, self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(-1, -1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        if isinstance(mask, DocumentLayout):  # packed documents: causal attention within each one
            q, k, v = (mask.to_documents(t) for t in (q, k, v))  # (D, L, nh, ·)
            out = self._attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, fused)
            return mask.from_documents(out.transpose(1, 2)).flatten(2)  # (B, T, nh·dv)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T|S, ·)
        out = self._attention(q, k, v, mask, is_causal, fused)
        return out.transpose(1, 2).reshape(b, q.shape[2], -1)  # (B, T, nh·dv)

    def _attention(self, q, k, v, mask, is_causal, fused=False):
        """q (B, nh, T, dqk), k (B, nh, S, dqk), v (B, nh, S, dv) → (B, nh, T, dv)."""
        if q.device.type == "cpu" and not fused and not gpu_path(q):
            # For training, attention as plain batched matmuls beats PyTorch's CPU SDPA kernels forward +
            # backward (the fused flash kernel also needs v padded to dqk; the A/B is in this file's git history).
            if torch.is_autocast_enabled("cpu"):  # autocast runs SDPA in its dtype; a Function is not cast
                q, k, v = (t.to(torch.get_autocast_dtype("cpu")) for t in (q, k, v))
            # One copy each into the (B, nh, ·, ·) layout: batched matmuls take a transposed last-two-
            # dims view as is, but a head dim strided inside T makes every fwd/bwd matmul copy again.
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if mask is None and is_causal:
                mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            return MatmulAttention.apply(q, k, v, mask, self.softmax_scale)
        if v.shape[-1] < q.shape[-1] and (q.device.type == "cpu" or gpu_path(q)):
            # Forward only (prefill), the CPU flash kernel wins by far, in bf16 and fp32: it skips the causal
            # half and never writes the scores. It wants v as wide as q and k (else it takes its much slower
            # unfused path), so v is zero-padded and the padding dropped. So does the CUDA flash kernel,
            # forward and backward (else SDPA takes the memory-efficient kernel): the GPU path pads too.
            v_pad = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
            out = F.scaled_dot_product_attention(q, k, v_pad, attn_mask=mask, is_causal=is_causal and mask is None,
                                                 scale=self.softmax_scale)
            return out[..., :v.shape[-1]]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                              scale=self.softmax_scale)

    def attend_absorbed(self, q_nope, q_pe, c_kv, k_pe, mask=None, kv_b_weight=None, latents=None):
        """Same contract as attend_naive, never materializing per-head keys or values. Batched matmuls
        over explicit layouts: torch.einsum's Python front end costs as much as a 512² matmul per call
        at decode sizes, and this runs once per layer per step. `latents` (B, S, r + dr): c_kv
        and k_pe side by side in one tensor (they are its views), when the caller has them so (serving's
        dense decode rows); attention is then one fused kernel over it (_attend_latents)."""
        w_uk, w_uv = self.kv_b_weights(kv_b_weight)  # (nh, dn, r), (nh, dv, r)
        b, t, nh, dn = q_nope.shape
        r = c_kv.shape[2]
        q = q_nope.permute(2, 0, 1, 3).reshape(nh, b * t, dn)
        q_latent = kernels.bmm(q, w_uk)  # (nh, B·T, r)
        q_latent = q_latent.view(nh, b, t, r).transpose(0, 1).reshape(b, nh * t, r)  # rows (head, query)
        q_rope = q_pe.transpose(1, 2).reshape(b, nh * t, -1)  # (B, nh·T, dr)
        if latents is not None:
            out_latent = self._attend_latents(torch.cat([q_latent, q_rope], dim=-1), latents, mask, t)
        else:
            out_latent = self._attend_split(q_latent, q_rope, c_kv, k_pe, mask, t)
        out_latent = out_latent.view(b, nh, t, r).transpose(0, 1).reshape(nh, b * t, r)
        out = kernels.bmm_t(out_latent, w_uv)  # (nh, B·T, dv)
        return out.view(nh, b, t, -1).permute(1, 2, 0, 3).reshape(b, t, -1)  # (B, T, nh·dv)

    def _attend_latents(self, q, latents, mask, t):
        """q (B, nh·T, r + dr) rows (head, query) against latents (B, S, r + dr) = [c_kv | k_pe] → (B, nh·T, r).
        One fused attention: the heads share their keys and values (the latents), so they are the query
        rows of a single-head attention, and each block of latents is read once for the scores and the
        weighted sum (the two batched matmuls read them twice). The values are the whole latents and the
        last dr columns of the output are dropped: PyTorch's CPU flash kernel wants the values as wide as
        the keys (with v = c_kv alone it falls back to its much slower unfused path). Faster than the two
        batched matmuls at decode in fp32 and bf16 (the A/B is in this file's git history)."""
        b, s, r = latents.shape[0], latents.shape[1], latents.shape[2] - self.cfg.qk_rope_head_dim
        prefix_mask = mask is None or mask.shape[:3] == (b, 1, 1)  # (B, 1, 1, S): one per decode row
        if t == 1 and kernels.ready() and kernels.attention_takes(latents) and prefix_mask:
            # our AVX-512 kernel (model/kernels.py); a decode row's mask keeps a prefix of its latents
            lengths = None if mask is None else mask.reshape(b, s).sum(-1)
            return torch.ops.seekforge.latent_attention(q, latents, lengths, self.softmax_scale, r)
        if mask is not None and t > 1:  # (B|1, 1|nh, T, S) → (B|1, 1, nh·T, S), the query rows' order
            mask = mask.expand(*mask.shape[:-3], self.num_heads, t, s).flatten(-3, -2).unsqueeze(-3)
        out = F.scaled_dot_product_attention(q[:, None], latents[:, None], latents[:, None], attn_mask=mask,
                                             scale=self.softmax_scale)
        return out[:, 0, :, :r]

    def _attend_split(self, q_latent, q_rope, c_kv, k_pe, mask, t):
        """q_latent (B, nh·T, r) and q_rope (B, nh·T, dr) against c_kv (B, S, r) and k_pe (B, S, dr) as
        separate tensors → (B, nh·T, r): batched matmuls, in chunks of sequences when the fp32 scores would
        outgrow SCORES_CHUNK_BYTES."""
        b, s, nh = c_kv.shape[0], c_kv.shape[1], self.num_heads
        rows = max(1, SCORES_CHUNK_BYTES // max(1, nh * t * s * 4))
        out_latent = []
        for i in range(0, b, rows):
            chunk = slice(i, i + rows)
            scores = torch.baddbmm(torch.bmm(q_rope[chunk], k_pe[chunk].transpose(1, 2)), q_latent[chunk],
                                   c_kv[chunk].transpose(1, 2))
            scores = scores.view(-1, nh, t, s).float() * self.softmax_scale  # (rows, nh, T, S), a new tensor
            if mask is not None:
                scores.masked_fill_(~(mask[chunk] if mask.dim() == 4 and mask.shape[0] > 1 else mask), float("-inf"))
            probs = scores.softmax(dim=-1).to(c_kv.dtype)
            out_latent.append(torch.bmm(probs.view(-1, nh * t, s), c_kv[chunk]))  # (rows, nh·T, r)
        return out_latent[0] if len(out_latent) == 1 else torch.cat(out_latent)

    def forward(self, x, cos, sin, mask=None, kv_cache=None):
        """Without a cache: full sequences, causal (or `mask`). With one, the cache object stores this
        step's latents and attends over everything cached (`LatentCache` here; the serving engine's
        paged cache has the same `attend` method). A `mask` with an `attend` method (context
        parallelism's, parallel/cp.py) attends the same way: over the keys of every cp rank."""
        if kv_cache is None and hasattr(mask, "attend"):
            kv_cache = mask
        q_nope, q_pe = self.project_q(x, cos, sin)
        c_kv, k_pe = self.project_latent(x, cos, sin)
        if kv_cache is None:
            out = self.attend_naive(q_nope, q_pe, c_kv, k_pe, mask=mask, is_causal=True)
        else:
            out = kv_cache.attend(self, q_nope, q_pe, c_kv, k_pe)
        return self.o_proj(out)


class MatmulAttention(torch.autograd.Function):
    """softmax(q·kᵀ·scale, masked) · v with an explicit backward, as batched matmuls in the inputs'
    dtype. q (B, nh, T, dqk), k (B, nh, S, dqk), v (B, nh, S, dv), mask (B|1, 1|nh, T, S) bool,
    True = keep (every query row keeps at least one key) → (B, nh, T, dv).

    Under bf16 this is eager attention as HF runs it under autocast: scores (q pre-scaled) and
    probabilities round to bf16, softmax and its backward accumulate in fp32 inside the kernel.
    Every pass over the (T, S) scores stays in the input dtype: at T = 256 those elementwise passes,
    not the matmuls, are what an fp32 softmax path spends its time on."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        q = q * scale  # scale the (T, dqk) queries rather than the (T, S) scores
        scores = torch.matmul(q, k.transpose(-1, -2))  # (B, nh, T, S)
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale
        return torch.matmul(probs, v)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probs = ctx.saved_tensors  # q pre-scaled
        grad_out = grad_out.to(q.dtype)
        grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
        grad_probs = torch.matmul(grad_out, v.transpose(-1, -2))  # (B, nh, T, S)
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        grad_q = torch.matmul(grad_scores, k).mul_(ctx.scale)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
        return grad_q, grad_k, grad_v, None, None


class LatentCache:
    """One layer's contiguous latent cache for B sequences that advance together (simple generate).
    Stores c_kv (B, S_max, r) and k_pe (B, S_max, dr): (r + dr) values per token instead of
    nh·(dqk + dv) — 576 vs 40960 for DeepSeek-V3."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        self.c_kv = torch.zeros(batch, max_len, cfg.kv_lora_rank, dtype=dtype, device=device)
        self.k_pe = torch.zeros(batch, max_len, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        self.length = 0

    def attend(self, attn: MLA, q_nope, q_pe, c_kv, k_pe):
        start, t = self.length, c_kv.shape[1]
        if start + t > self.c_kv.shape[1]:
            raise ValueError(f"sequence length {start + t} exceeds the cache size {self.c_kv.shape[1]}")
        self.c_kv[:, start:start + t] = c_kv
        self.k_pe[:, start:start + t] = k_pe
        self.length = end = start + t
        if t == 1:  # decode: absorbed path straight against the latents
            return attn.attend_absorbed(q_nope, q_pe, self.c_kv[:, :end], self.k_pe[:, :end])
        # prefill (possibly after a cached prefix): query i sees keys 0..start+i
        mask = torch.ones(t, end, dtype=torch.bool, device=c_kv.device).tril(start)
        return attn.attend_naive(q_nope, q_pe, self.c_kv[:, :end], self.k_pe[:, :end], mask=mask)


# ---------------------------------------------------------------------------------------- block
class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_id) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask=None, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------- MTP
class MTPModule(nn.Module):
    """Multi-Token Prediction (DeepSeek-V3 §2.2).

    MTP module k (1-based depth) predicts token t+k+1 at position t: it combines the previous depth's
    hidden state h^{k-1}_t with the embedding of token t+k,
        h'_t = eh_proj([enorm(Emb(x_{t+k})); hnorm(h^{k-1}_t)]),
    runs one transformer block over h', and scores it with the shared output head after its own norm.
    Embedding and head are shared with the main model (the paper's design; HF checkpoints store copies).
    The objective that trains it is model/loss.py's `mtp_losses`.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = Block(cfg, layer_id)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # HF: shared_head.norm

    def forward(self, h_prev, next_embeds, cos, sin, mask=None, kv_cache=None):
        """h_prev, next_embeds (B, T, H) → this depth's hidden (B, T, H), before `norm`. h_prev at
        depth 1 is the main model's hidden before its final norm (see loss.mtp_losses)."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(h_prev)], dim=-1))
        return self.block(x, cos, sin, mask, kv_cache)


# ---------------------------------------------------------------------------------------- model
def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids (B, T) of packed documents → (B, 1, T, T) bool: causal within each document.
    The reference for DocumentLayout, which attention uses instead."""
    t = segment_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same_doc)[:, None]


class DocumentLayout:
    """Packed documents of a (B, T) batch re-laid one per row of a right-padded (D, L) batch, so that
    attention costs Σ len² instead of the T² per row that a block-diagonal mask computes densely
    (most of it masked: a row of 7 documents wastes 6/7 of it), as varlen flash attention does.

    Right padding keeps plain causal attention exact: a real query only sees keys at or before it,
    all real; the padded queries' outputs are never gathered back. Every token belongs to exactly one
    document (a run of equal segment ids within a row)."""

    def __init__(self, segment_ids: torch.Tensor, round_len=None):
        """round_len: L → the L to lay out (≥ L), e.g. precision.onednn_size for shapes that repeat."""
        b, t = segment_ids.shape
        flat = segment_ids.flatten()  # (B·T,)
        starts = torch.ones_like(flat, dtype=torch.bool)
        starts[1:] = flat[1:] != flat[:-1]
        starts[::t] = True  # a row always starts a document
        document = starts.cumsum(0) - 1  # (B·T,) document of each token
        first = starts.nonzero().squeeze(1)  # (D,) flat index of each document's first token
        self.max_len = int(torch.bincount(document).max())  # L
        if round_len is not None:
            self.max_len = round_len(self.max_len)
        self.num_documents, self.shape = len(first), (b, t)
        position = torch.arange(b * t, device=flat.device)
        # token → its slot in the padded (D·L) layout, and slot → token (padding slots read token 0)
        self.slot_of_token = document * self.max_len + position - first[document]  # (B·T,)
        self.token_of_slot = torch.zeros(self.num_documents * self.max_len, dtype=torch.long, device=flat.device)
        self.token_of_slot[self.slot_of_token] = position

    def to_documents(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) → (D, L, ...)."""
        return _Relayout.apply(x.flatten(0, 1), self, True).unflatten(0, (self.num_documents, self.max_len))

    def from_documents(self, x: torch.Tensor) -> torch.Tensor:
        """(D, L, ...) → (B, T, ...): each token's own row back, padding dropped."""
        return _Relayout.apply(x.flatten(0, 1), self, False).unflatten(0, self.shape)


class _Relayout(torch.autograd.Function):
    """A DocumentLayout's gather between the packed (B·T, ...) and the per-document (D·L, ...) rows, with
    the inverse gather as backward: autograd's own backward for x[index] is a scattered accumulate
    (index_put_, serial on CPU: a visible share of a GRPO training phase). Exact because every token has exactly
    one slot: to the documents, a padding slot repeats token 0 but its gradient is zero (a padded
    query's output is never gathered back, and causal attention never reads a right-padded key), so a
    token's gradient is its own slot's; back from them, the padding slots' gradient is zero."""

    @staticmethod
    def forward(ctx, x, layout: DocumentLayout, to_documents: bool):
        ctx.layout, ctx.to_documents = layout, to_documents
        return x.index_select(0, layout.token_of_slot if to_documents else layout.slot_of_token)

    @staticmethod
    def backward(ctx, grad):
        slots = ctx.layout.slot_of_token
        if ctx.to_documents:
            return grad.index_select(0, slots), None, None
        return grad.new_zeros(len(ctx.layout.token_of_slot), *grad.shape[1:]).index_copy_(0, slots, grad), None, None


class Transformer(nn.Module):
    """DeepSeek-V3 decoder with optional MTP modules (`mtp`, see MTPModule).

    forward(input_ids) → logits (B, T, V); `hidden(...)` stops before the head, for the loss code
    and MTP. Packed training passes per-document `positions` and `segment_ids`.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = nn.ModuleList(
            MTPModule(cfg, cfg.num_hidden_layers + k) for k in range(cfg.num_nextn_predict_layers)
        )

    def hidden(self, input_ids, positions=None, segment_ids=None, kv_caches=None, attention=None):
        """input_ids (B, T) → (hidden before the final norm (B, T, H), (cos, sin), mask).
        kv_caches: one cache object per layer (see MLA.forward), for generation. attention: an object
        with `attend(attn, q_nope, q_pe, c_kv, k_pe)` that every MLA uses instead of causal attention
        over this row (context parallelism, parallel/cp.py); it is returned as the mask, so MTP uses it too."""
        if positions is None:
            start = kv_caches[0].length if kv_caches is not None else 0
            positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary(positions)
        mask = None
        if segment_ids is not None:  # on oneDNN, document lengths from a small set: its kernels are built once
            onednn_shapes = uses_onednn(input_ids.device, matmul_dtype(self.embed_tokens.weight))
            mask = DocumentLayout(segment_ids, onednn_size if onednn_shapes else None)
        if attention is not None:
            mask = attention
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if kv_caches is None else kv_caches[i])
        return x, (cos, sin), mask

    def forward(self, input_ids, positions=None, segment_ids=None, kv_caches=None):
        x, _, _ = self.hidden(input_ids, positions, segment_ids, kv_caches)
        return self.lm_head(self.norm(x))

    def cast(self, dtype: torch.dtype):
        """The weights in `dtype`, except the routing state (each MoE gate's weight and bias), which stays
        fp32 as in the official checkpoints; the fp32 buffers recreated (`init_buffers`), not rounded."""
        self.to(dtype)
        for moe in self.moe_layers():
            moe.gate.float()
        return self.init_buffers()

    def init_buffers(self):
        """(Re)create the non-persistent buffers: after `to_empty` they hold garbage, and a dtype cast
        would round them — they stay fp32 / int64 whatever the weights' dtype (bf16 frequencies blur
        positions; bf16 counts stop being exact at 256)."""
        device = self.embed_tokens.weight.device
        self.rotary.inv_freq = rope_inv_freq(self.cfg).to(device)
        for moe in self.moe_layers():
            moe.tokens_per_expert = torch.zeros(self.cfg.n_routed_experts, dtype=torch.long, device=device)
        return self

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Normal(0, initializer_range) for matrices, ones for norms, zeros for routing bias."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm"):
                p.fill_(1.0)
            elif gen is not None and p.device.type == "cpu":
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
            else:
                nn.init.normal_(p, std=std)
        for m in self.moe_layers():
            m.gate.e_score_correction_bias.zero_()
        return self


def block_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every transformer Block of a Transformer or a pipeline stage as (container, name): the main
    layers in order, then each MTP module's block. `getattr(container, name)` is the block (or what
    parallel/ wrapped it in); `setattr` replaces it in place."""
    layers = getattr(model, "layers", [])
    names = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else [str(i) for i in range(len(layers))]
    return [(layers, name) for name in names] + [(module, "block") for module in getattr(model, "mtp", [])]


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype=torch.float32, seed: int = 0):
    """A randomly initialized model; `device="meta"` builds shapes only (for planning huge presets)."""
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
        model.cast(dtype)
    return model
