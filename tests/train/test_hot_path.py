"""Equivalence of the CPU fast paths the train-step benchmark relies on (model/moe.py, model/model.py)
against the paths they replace."""

import pytest
import torch
import torch.nn.functional as F

from seekforge.config import preset
from seekforge.model.model import MLA, document_mask
from seekforge.model.moe import grouped_mm, grouped_mm_reference


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_grouped_mm_loop_matches_torch_grouped_mm(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 10])  # includes an empty expert
    x = torch.randn(int(counts.sum()), 32, generator=gen).to(dtype)
    w = torch.randn(4, 48, 32, generator=gen).to(dtype)
    fused = torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    torch.testing.assert_close(grouped_mm(x, w, counts), fused, rtol=tol, atol=tol)
    torch.testing.assert_close(grouped_mm_reference(x, w, counts), fused, rtol=tol, atol=tol)


@pytest.mark.parametrize("packed", [False, True])
def test_padded_v_attention_matches_unpadded(packed):
    """attend_naive zero-pads v to the q/k head dim on CPU (fused flash kernel); the reference is
    the math path with the natural v_head_dim (16 vs qk_head_dim 24 in the tiny preset)."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    attn = MLA(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    b, t = 2, 12
    q_nope = torch.randn(b, t, cfg.num_attention_heads, cfg.qk_nope_head_dim, requires_grad=True)
    q_pe = torch.randn(b, t, cfg.num_attention_heads, cfg.qk_rope_head_dim)
    c_kv = torch.randn(b, t, cfg.kv_lora_rank, requires_grad=True)
    k_pe = torch.randn(b, t, cfg.qk_rope_head_dim)
    mask = document_mask(torch.tensor([[0] * 5 + [1] * 7] * b)) if packed else None
    out = attn.attend_naive(q_nope, q_pe, c_kv, k_pe, mask=mask, is_causal=True)

    kv = attn.kv_b_proj(c_kv).view(b, t, cfg.num_attention_heads, -1)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, cfg.num_attention_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=causal if mask is None else mask, scale=attn.softmax_scale)
    ref = ref.transpose(1, 2).reshape(b, t, -1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q_nope, c_kv))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q_nope, c_kv))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
