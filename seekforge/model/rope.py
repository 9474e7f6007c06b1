"""Rotary position embedding and YaRN (arXiv:2309.00071), all of it: the frequencies, the cos/sin
multiplier, the softmax scale's mscale², and the rotation of q and k. The config only names the
scaling (ModelConfig.rope_scaling); the math is here.

Shape legend as model/model.py: B batch, T tokens, nh heads, dr = qk_rope_head_dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seekforge.config import ModelConfig, rope_type


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN §3.4's attention-entropy factor 0.1·ln(s) + 1, DeepSeek's form with a coefficient."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(cfg: ModelConfig) -> float:
    rope = cfg.rope_scaling or {}
    factor = rope.get("factor")
    if factor is None:  # DeepSeek convention: ratio of the extended to the original context
        factor = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
    return float(factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d_qk), times mscale² under YaRN: the attention-entropy correction of YaRN §3.4
    is applied to both q and k, so the logits scale by its square (as HF and DeepSeek do)."""
    scale = cfg.qk_head_dim**-0.5
    rope = cfg.rope_scaling or {}
    if rope_type(rope) == "yarn":
        mscale_all_dim = rope.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(yarn_factor(cfg), mscale_all_dim)
            scale *= m * m
    return scale


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(dr/2,) inverse frequencies; YaRN (arXiv:2309.00071 §3.3) blends interpolated and original
    frequencies with a linear ramp over the dims between beta_slow and beta_fast rotations."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    inv_freq = 1.0 / pos_freqs
    rope = cfg.rope_scaling or {}
    if rope_type(rope) != "yarn":
        return inv_freq
    factor = yarn_factor(cfg)
    original = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(correction_dim(beta_fast)), math.ceil(correction_dim(beta_slow))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's multiplier on cos/sin (1.0 for DeepSeek-V3, where mscale == mscale_all_dim)."""
    rope = cfg.rope_scaling or {}
    if rope_type(rope) != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, mscale, mscale_all = yarn_factor(cfg), rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
    return yarn_get_mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_factor = rope_attention_factor(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (..., T) → cos, sin (..., T, dr/2) in fp32."""
        angles = positions[..., None].float() * self.inv_freq
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x (B, T, [nh,] dr). DeepSeek checkpoints pair dims (0,1), (2,3)… (`interleave`); the output lays
    the pairs out as [evens | odds] rotated, the same for q and k, so q·k is unchanged (as in HF)."""
    if x.dim() == 4:  # per-head tensor: broadcast cos/sin over heads
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over the two halves
    half = x.shape[-1] // 2
    # (..., 2, dr/2) = [x1; x2]: five ops where [x1·cos − x2·sin | x2·cos + x1·sin] took nine (each op costs
    # microseconds at decode sizes); the same products and sums, so the same bits. Copied contiguous first:
    # x is a slice of q or of the latent projection, and the interleaved pairs a transposed view of it, which
    # the elementwise ops walk several times slower than a contiguous copy, in prefill and in training alike.
    pairs = x.unflatten(-1, (half, 2)).transpose(-1, -2) if interleave else x.unflatten(-1, (2, half))
    pairs = pairs.contiguous()
    rotated = pairs.flip(-2) * sin  # [x2·sin; x1·sin]
    rotated[..., 0, :].neg_()
    return (pairs * cos).add_(rotated).flatten(-2)
