"""Equivalence of the CPU fast paths the train-step benchmark relies on (model/moe.py, model/model.py)
against the paths they replace."""

import pytest
import torch
import torch.nn.functional as F

from seekforge.config import preset
from seekforge.model.model import MLA, document_mask
from seekforge.model.moe import grouped_mm, grouped_mm_reference, swiglu


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="older torch without _grouped_mm")
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
@pytest.mark.parametrize("autocast", [False, True])
def test_matmul_attention_matches_sdpa(packed, autocast):
    """attend_naive on CPU runs MatmulAttention (batched matmuls, explicit backward); the reference
    is F.scaled_dot_product_attention's math path in fp32 on the same q/k/v, causal or with a
    packed-document mask. fp32: 1e-5 values, 1e-4 gradients. bf16 autocast: scores and
    probabilities round to bf16 (as HF's eager attention does), 2e-2 relative to the largest value."""
    torch.manual_seed(0)
    cfg = preset("tiny")
    attn = MLA(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    b, t = 2, 12
    q_nope = torch.randn(b, t, cfg.num_attention_heads, cfg.qk_nope_head_dim, requires_grad=True)
    q_pe = torch.randn(b, t, cfg.num_attention_heads, cfg.qk_rope_head_dim, requires_grad=True)
    c_kv = torch.randn(b, t, cfg.kv_lora_rank, requires_grad=True)
    k_pe = torch.randn(b, t, cfg.qk_rope_head_dim, requires_grad=True)
    mask = document_mask(torch.tensor([[0] * 5 + [1] * 7] * b)) if packed else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = attn.attend_naive(q_nope, q_pe, c_kv, k_pe, mask=mask, is_causal=True).float()

    kv = attn.kv_b_proj(c_kv).view(b, t, cfg.num_attention_heads, -1)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, cfg.num_attention_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=causal if mask is None else mask, scale=attn.softmax_scale)
    ref = ref.transpose(1, 2).reshape(b, t, -1)
    inputs = (q_nope, q_pe, c_kv, k_pe, attn.kv_b_proj.weight)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    for ours, expected, tol in [(out, ref, 1e-5), *((g, r, 1e-4) for g, r in zip(grads, ref_grads, strict=True))]:
        tol = 2e-2 if autocast else tol
        scale = expected.abs().max() if autocast else 1.0
        torch.testing.assert_close(ours / scale, expected / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("autocast", [False, True])
def test_expert_loop_mm_matches_reference(autocast):
    """The CPU per-expert loop as one autograd Function (outputs and weight gradients written in
    place) against autograd through grouped_mm_reference: values and gradients of x and the
    stacked weight, with an empty expert. fp32: same mms, so 1e-6; bf16 autocast: the gradient is
    rounded to bf16 once per expert either way, 1e-2 relative."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 10])
    x = torch.randn(int(counts.sum()), 32, generator=gen, requires_grad=True)
    w = torch.randn(4, 48, 32, generator=gen, requires_grad=True)
    g = torch.randn(int(counts.sum()), 48, generator=gen)
    results = []
    for fn in (grouped_mm, grouped_mm_reference):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(x, w, counts)
        results.append((out.float(), *torch.autograd.grad(out.float(), (x, w), g)))
    tol = 1e-2 if autocast else 1e-6
    for ours, ref in zip(*results, strict=True):
        torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    assert (results[0][2][1] == 0).all()  # the empty expert's gradient is zero, not garbage


def test_bucketed_expert_rows_match_reference():
    """bf16 on CPU: each expert's rows are zero-padded to a bucketed count (BucketedRows: oneDNN builds a
    kernel per new shape), the padding dropped again. Values and gradients equal autograd through
    grouped_mm_reference's exact mms within bf16 rounding; the buckets repeat and waste ≤ 12.5%."""
    from seekforge.model.moe import BucketedRows
    from seekforge.model.precision import onednn_size

    buckets = [onednn_size(n) for n in range(1, 4097)]
    assert buckets[:64] == list(range(1, 65)) and buckets == sorted(buckets)
    assert all(n <= b <= 1.125 * n for n, b in enumerate(buckets, start=1))
    assert len({b for b in buckets if 1024 < b <= 2048}) == 8  # 8 shapes per doubling

    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([70, 0, 129, 3, 64])
    x = torch.randn(int(counts.sum()), 32, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(5, 48, 32, generator=gen).bfloat16().requires_grad_()
    g = torch.randn(int(counts.sum()), 48, generator=gen).bfloat16()
    rows = BucketedRows.for_mm(x, counts.tolist())
    assert rows.padded_counts == [72, 0, 144, 3, 64]
    assert torch.equal(rows.unpad(rows.pad(x.detach())), x.detach())
    assert BucketedRows.for_mm(x.float(), counts.tolist()) is None  # fp32 runs on MKL: no padding
    results = []
    for fn in (grouped_mm, grouped_mm_reference):
        out = fn(x, w, counts)
        results.append((out, *torch.autograd.grad(out, (x, w), g)))
    for ours, ref in zip(*results, strict=True):
        scale = ref.float().abs().max()
        torch.testing.assert_close(ours.float() / scale, ref.float() / scale, rtol=1e-2, atol=1e-2)
    assert (results[0][2][1] == 0).all()  # the empty expert's gradient is zero


def test_gather_copies_matches_indexing():
    """dispatch's gather with the permutation-aware backward == x[token_of_copy] in autograd."""
    from seekforge.model.moe import gather_copies

    gen = torch.Generator().manual_seed(0)
    n, k = 9, 3
    indices = torch.rand(n, 5, generator=gen).topk(k, dim=-1).indices
    order = indices.reshape(-1).argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n * k))
    x = torch.randn(n, 4, generator=gen, requires_grad=True)
    g = torch.randn(n * k, 4, generator=gen)
    ours = gather_copies(x, order // k, inverse, k)
    ref = x[order // k]
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(ours, x, g)[0], torch.autograd.grad(ref, x, g)[0])


def _moe_reference(moe, x):
    """The MoE layer as it was before the CPU fast paths: fancy-index gather, per-expert loop under
    autograd (autocast casting each expert's slice), index_copy_ + einsum combine."""
    x = x.reshape(-1, x.shape[-1])
    weights, indices, _ = moe.gate(x)
    k = indices.shape[1]
    order = indices.reshape(-1).argsort(stable=True)
    counts = torch.bincount(indices.reshape(-1), minlength=moe.cfg.n_routed_experts)
    routed = x[order // k]
    gate, up = grouped_mm_reference(routed, moe.experts.gate_up_proj, counts).chunk(2, dim=-1)
    y = grouped_mm_reference(F.silu(gate) * up, moe.experts.down_proj, counts)
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(x.shape[0], k, -1)
    return torch.einsum("nkh,nk->nh", unsorted, weights.to(y.dtype)) + moe.shared_experts(x)


@pytest.mark.parametrize("autocast", [False, True])
def test_moe_layer_matches_reference(autocast):
    """Whole MoE layer (small-preset shapes, fewer tokens), output and every gradient, against the
    pre-optimization path. fp32: 1e-5. bf16 autocast: the new path casts the tokens before the
    gather and rounds the weighted products to bf16 before summing over k; tolerance 2e-2 relative
    to values of O(1) (a few bf16 ulps)."""
    from seekforge.model.moe import MoE

    cfg = preset("small")
    torch.manual_seed(0)
    moe = MoE(cfg).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(2, 64, cfg.hidden_size, requires_grad=True)
    results = []
    for fn in (lambda: moe(x), lambda: _moe_reference(moe, x).view(x.shape)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn()
        params = [x, *moe.parameters()]
        grads = torch.autograd.grad(out.float().square().sum(), params)
        results.append([out.float(), *grads])
    tol = 2e-2 if autocast else 1e-5
    for ours, ref in zip(*results, strict=True):
        scale = ref.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(ours / scale, ref / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6)])
def test_chunked_cross_entropy_matches_fp32_cross_entropy(dtype, tol):
    """train/loss.py's chunked cross-entropy against F.cross_entropy on the fp32 upcast of the same
    logits (what the loss did before), with ignored rows and more rows than one chunk: loss and
    logits gradient. Both compute in fp32 from the same values; the gradient is returned in the
    logits' dtype, so bf16 is compared after rounding the reference gradient to bf16 too."""
    from seekforge.model.loss import _ChunkedCrossEntropy, cross_entropy

    gen = torch.Generator().manual_seed(0)
    vocab = 300
    n = 3 * max(16, _ChunkedCrossEntropy.CHUNK_ELEMENTS // vocab) + 5
    logits = (4 * torch.randn(n, vocab, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::7] = -100
    ours = cross_entropy(logits, labels, -100)
    ref = F.cross_entropy(logits.float(), labels, ignore_index=-100)
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    g_ours = torch.autograd.grad(ours, logits)[0]
    g_ref = torch.autograd.grad(ref, logits)[0]
    assert g_ours.dtype == dtype
    torch.testing.assert_close(g_ours.float(), g_ref.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-7)
    assert torch.isnan(cross_entropy(logits, torch.full((n,), -100), -100))  # as F.cross_entropy


@pytest.mark.parametrize("autocast", [False, True])
def test_rms_norm_fp32_fused_matches_unfused(autocast):
    """RMSNorm on an fp32 input (the residual stream, also under bf16 autocast) runs the weighted
    fused kernel; the reference is the unfused fp32 path (normalize, then scale): values and
    gradients of input and weight within 1e-5."""
    from seekforge.model.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = norm(x)
    assert out.dtype == torch.float32
    ref = norm.weight * F.rms_norm(x, (64,), eps=norm.eps)
    g = torch.randn_like(ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for ours, expected in zip(torch.autograd.grad(out, (x, norm.weight), g),
                              torch.autograd.grad(ref, (x, norm.weight), g), strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_swiglu_function_matches_autograd(dtype, packed):
    """model/moe.py's _SwiGLU runs the same elementwise ops in the same dtype as autograd's
    F.silu(gate) * up (after a chunk, for the experts' packed gate_up): tolerance 0, values and
    gradients."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(37, 2 * 24, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(37, 24, generator=gen).to(dtype)

    def reference(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    def ours(t):
        return swiglu(t) if packed else swiglu(*t.chunk(2, dim=-1))

    out, ref = ours(gate_up), reference(gate_up)
    (grad,), (ref_grad,) = torch.autograd.grad(out, gate_up, grad_out), torch.autograd.grad(ref, gate_up, grad_out)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)
