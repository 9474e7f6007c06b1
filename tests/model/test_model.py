"""Model math: dropless MoE, grouped GEMM vs loop, absorbed vs naive MLA, RoPE/YaRN, meta init."""

import pytest
import torch

from seekforge.config import preset
from seekforge.model import kernels
from seekforge.model.model import DocumentLayout, LatentCache, RMSNorm, build_model, document_mask
from seekforge.model.moe import (
    ExpertSlots,
    GroupedExperts,
    LocalDispatcher,
    MoE,
    grouped_mm,
    grouped_mm_reference,
    select_experts,
)
from seekforge.model.precision import onednn_size

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")  # the declared torch range starts before it


def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token, expert-by-expert loop: the definition the dropless path must equal."""
    x = x.reshape(-1, x.shape[-1])
    weights, indices, _ = moe.gate(x)
    out = torch.zeros_like(x)
    e = moe.experts
    inter = e.down_proj.shape[-1]
    for t in range(x.shape[0]):
        for w, k in zip(weights[t], indices[t], strict=True):
            gate, up = e.gate_up_proj[k, :inter], e.gate_up_proj[k, inter:]
            h = torch.nn.functional.silu(x[t] @ gate.t()) * (x[t] @ up.t())
            out[t] += w * (h @ e.down_proj[k].t())
    return out + moe.shared_experts(x)


@pytest.mark.parametrize("shape", [(1, 192), (2, 7, 512)])
@pytest.mark.parametrize("grads", ["both", "input", "weight"])
def test_rms_norm_equals_reference(shape, grads):
    """The CPU fp32 RMSNorm's own forward and backward against F.rms_norm's (autograd of its ops)."""
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1])
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (3 * torch.randn(shape)).requires_grad_(grads != "weight")
    norm.weight.requires_grad_(grads != "input")
    grad = torch.randn(shape)
    results = []
    for fn in (norm, lambda t: torch.nn.functional.rms_norm(t, (shape[-1],), norm.weight, norm.eps)):
        x.grad = norm.weight.grad = None
        out = fn(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, norm.weight.grad))
    for ours, reference in zip(*results, strict=True):
        if reference is None:
            assert ours is None
        else:
            torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)
    for rows in (1, 16, 64):  # serving (no autograd): F.rms_norm below 16 rows, its own math from 16
        x = torch.randn(rows, shape[-1])
        with torch.no_grad():
            torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (shape[-1],), norm.weight, norm.eps))


@pytest.mark.parametrize("skew", [False, True])
def test_moe_dropless_equals_loop(skew):
    cfg = preset("tiny")
    model = build_model(cfg)
    moe = model.layers[1].mlp
    x = torch.randn(3, 10, cfg.hidden_size)
    if skew:  # every token's top choice is expert 5, and the bias pushes expert 6 in too
        with torch.no_grad():
            moe.gate.weight.zero_()
            moe.gate.weight[5] = 1.0
            moe.gate.e_score_correction_bias[6] = 10.0
        x = x.abs() + 0.1
    moe.tokens_per_expert.zero_()
    out = moe(x)
    torch.testing.assert_close(out.view(-1, cfg.hidden_size), moe_reference(moe, x), atol=1e-5, rtol=1e-5)
    counts = moe.tokens_per_expert
    assert counts.sum() == x.shape[0] * x.shape[1] * cfg.num_experts_per_tok  # no token copy dropped
    if skew:
        assert counts[5] == 30 and counts[6] == 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_experts_equal_dispatch(dtype, monkeypatch):
    """Batch-1 decoding's direct path (GroupedExperts.forward_one_token) against the sorted dispatch it
    skips (the path taken with autograd on), and both against the loop definition. With torch's mms, so the
    sums run in the same order (the few-row kernel's path: tests/model/test_kernels.py)."""
    monkeypatch.setattr(kernels, "_loaded", False)
    cfg = preset("tiny")
    moe = build_model(cfg, dtype=dtype).layers[1].mlp.eval()
    for seed in range(4):
        x = torch.randn(1, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        with torch.no_grad():
            assert moe._plain_inference(x.view(1, -1))
            fast = moe(x)
        with torch.enable_grad():
            assert not moe._plain_inference(x.view(1, -1))
            dispatched = moe(x).detach()
        torch.testing.assert_close(fast, dispatched, rtol=0, atol=0)
        if dtype == torch.float32:
            torch.testing.assert_close(fast.view(1, -1), moe_reference(moe, x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [8, 64, 300])
def test_batched_experts_equal_dispatch(tokens, dtype):
    """Inference on CPU: the padded (E, C) batch of GroupedExperts.forward_batched against the sorted
    dispatch (the path taken with autograd on): within bf16 rounding (bmm vs per-expert mm round alike, each
    accumulating in fp32), within fp32 summation order in fp32."""
    cfg = preset("tiny")
    moe = build_model(cfg, dtype=dtype).layers[1].mlp.eval()
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.no_grad():
        weights, indices, _ = moe.gate(x)
        if dtype == torch.bfloat16:
            assert moe._routed_inference(x, weights, indices) is not None  # the batched path is taken
            fast = moe(x)
        else:  # taken at ≤ 1.5x padding, which random routing of a few tokens may exceed: called directly
            slots = ExpertSlots.within(indices, cfg.n_routed_experts, max_padding=cfg.n_routed_experts)
            fast = moe.experts.forward_batched(x, weights, slots) + moe.shared_experts(x)
    with torch.enable_grad():
        dispatched = moe(x).detach()
    if dtype == torch.float32:
        torch.testing.assert_close(fast, dispatched, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(fast.float(), dispatched.float(), rtol=2e-2, atol=2e-2)
        assert (fast.float() - dispatched.float()).abs().mean() < 1e-3

    slots = ExpertSlots.within(indices, cfg.n_routed_experts, max_padding=cfg.n_routed_experts)
    counts = torch.bincount(indices.reshape(-1), minlength=cfg.n_routed_experts)
    assert slots.cap == onednn_size(int(counts.max()))
    assert slots.index.unique().numel() == indices.numel()  # one slot per copy
    torch.testing.assert_close(slots.index // slots.cap, indices.reshape(-1))  # in its expert's rows
    for e in range(cfg.n_routed_experts):  # at ranks 0, 1, … in copy order
        torch.testing.assert_close(slots.index[indices.reshape(-1) == e] % slots.cap, torch.arange(int(counts[e])))
    # as a compiled decode step traces them (serve/compiled.py): the same slots, the cap from tensor ops
    # (8+ tokens, each to K experts of E < 8·K: some expert has 2+ copies, above the traced cap's floor of 2)
    traced = ExpertSlots.traced(indices, cfg.n_routed_experts, onednn_shapes=True)
    assert traced.cap == slots.cap
    torch.testing.assert_close(traced.index, slots.index, rtol=0, atol=0)
    assert ExpertSlots.traced(indices, cfg.n_routed_experts, onednn_shapes=False).cap == int(counts.max())


def test_batched_experts_bounded_padding():
    """Routing every token to one of many experts would pad the batch E/K-fold: the per-expert loop runs
    instead. fp32 (MKL) takes the batch at up to 1.5x padding, bf16 (oneDNN) at up to 4x."""
    for dtype in (torch.bfloat16, torch.float32):
        cfg = preset("tiny", num_experts_per_tok=1)
        moe = build_model(cfg, dtype=dtype).layers[1].mlp.eval()
        x = torch.randn(32, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            moe.gate.e_score_correction_bias[3] = 100.0
            weights, indices, _ = moe.gate(x)
            assert (indices == 3).all()
            assert moe._routed_inference(x, weights, indices) is None  # padding E/K = 8
    fp32 = build_model(preset("tiny")).layers[1].mlp.eval()  # 8 experts, top-2
    x = torch.randn(4, fp32.cfg.hidden_size)
    with torch.no_grad():
        balanced = torch.arange(8).view(4, 2)  # every expert once: no padding
        skewed = torch.tensor([[0, 1], [0, 2], [0, 3], [4, 5]])  # 4 × 8 slots for 8 copies: 4x
        for chosen, taken in ((balanced, True), (skewed, False)):
            weights = torch.full((4, 2), 0.5)
            assert (fp32._routed_inference(x, weights, chosen) is not None) == taken


def test_bias_selects_but_does_not_weight():
    cfg = preset("tiny")
    moe = build_model(cfg).layers[1].mlp
    x = torch.randn(16, cfg.hidden_size)
    w0, i0, scores = moe.gate(x)
    moe.gate.e_score_correction_bias[3] = 100.0
    w1, i1, _ = moe.gate(x)
    assert (i1 == 3).any(dim=-1).all()
    # weights are the unbiased scores of the chosen experts, normalized and scaled
    expect = scores.gather(1, i1)
    expect = expect / expect.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    torch.testing.assert_close(w1, expect)


def test_group_limited_topk_stays_in_top_groups():
    cfg = preset("small")  # 16 experts in 4 groups, top-2 groups, top-4 experts
    scores = torch.rand(64, cfg.n_routed_experts)
    idx = select_experts(scores, torch.zeros(cfg.n_routed_experts), cfg)
    groups = idx // (cfg.n_routed_experts // cfg.n_group)
    assert all(len(set(g.tolist())) <= cfg.topk_group for g in groups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 11, 16], [32, 0, 0, 0], [0, 0, 0, 0]])
def test_grouped_mm_equals_loop(dtype, counts):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 32, dtype=dtype)
    w = torch.randn(4, 48, 32, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = grouped_mm_reference(x, w, counts)
    assert ref.shape == (x.shape[0], 48)
    torch.testing.assert_close(grouped_mm(x, w, counts), ref, atol=tol, rtol=tol)  # no grad: the plain loop
    # with grad: the same loop inside _ExpertLoopMM
    torch.testing.assert_close(grouped_mm(x.clone().requires_grad_(), w, counts).detach(), ref, atol=tol, rtol=tol)
    if not HAS_GROUPED_MM:
        return
    # The grouped-GEMM kernel itself (the dispatcher uses it wherever it is faster, e.g. on GPU).
    offsets = counts.cumsum(0).to(torch.int32)
    kernel = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    torch.testing.assert_close(kernel, ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="older torch without _grouped_mm")
def test_grouped_mm_kernel_backward_matches_loop():
    counts = torch.tensor([3, 9, 0, 4])
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(4, 48, 32, requires_grad=True)
    torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets).square().sum().backward()
    grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    grouped_mm_reference(x, w, counts).square().sum().backward()
    torch.testing.assert_close(grads[0], x.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[1], w.grad, atol=1e-4, rtol=1e-4)


def test_grouped_experts_backward_matches_loop():
    counts = torch.tensor([3, 9, 0, 4])
    x = torch.randn(16, 32, requires_grad=True)
    experts = GroupedExperts(4, 32, 16)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    experts(x, counts).square().sum().backward()
    grads = [x.grad.clone(), experts.gate_up_proj.grad.clone()]
    x.grad = None
    experts.gate_up_proj.grad = None
    gate, up = grouped_mm_reference(x, experts.gate_up_proj, counts).chunk(2, dim=-1)
    grouped_mm_reference(torch.nn.functional.silu(gate) * up, experts.down_proj, counts).square().sum().backward()
    torch.testing.assert_close(grads[0], x.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[1], experts.gate_up_proj.grad, atol=1e-4, rtol=1e-4)


def test_dispatch_combine_roundtrip():
    x = torch.randn(7, 8)
    indices = torch.tensor([[0, 2]] * 7)
    d = LocalDispatcher()
    routed, counts, order = d.dispatch(x, indices, 3)
    assert counts.tolist() == [7, 0, 7]
    out = d.combine(routed, order, torch.full((7, 2), 0.5))
    torch.testing.assert_close(out, x)


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None},
                                       {"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 0.7,
                                                         "mscale_all_dim": 0.7,
                                                         "original_max_position_embeddings": 32}}])
def test_absorbed_decode_equals_naive(overrides):
    """The same latent cache attended two ways gives the same output, and cached decoding gives
    the same logits as a full forward."""
    cfg = preset("tiny", **overrides)
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    full = model(ids)
    caches = [LatentCache(cfg, 2, 40) for _ in model.layers]
    prefill = model(ids[:, :30], kv_caches=caches)
    steps = [model(ids[:, t:t + 1], kv_caches=caches) for t in range(30, 40)]
    cached = torch.cat([prefill, *steps], dim=1)
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)

    attn = model.layers[0].self_attn
    q_nope = torch.randn(2, 3, cfg.num_attention_heads, cfg.qk_nope_head_dim)
    q_pe = torch.randn(2, 3, cfg.num_attention_heads, cfg.qk_rope_head_dim)
    c_kv, k_pe = torch.randn(2, 9, cfg.kv_lora_rank), torch.randn(2, 9, cfg.qk_rope_head_dim)
    mask = torch.ones(3, 9, dtype=torch.bool).tril(6)
    torch.testing.assert_close(attn.attend_absorbed(q_nope, q_pe, c_kv, k_pe, mask),
                               attn.attend_naive(q_nope, q_pe, c_kv, k_pe, mask), atol=1e-5, rtol=1e-5)
    latents = torch.cat([c_kv, k_pe], dim=-1)  # the scores as one matmul over both (serving's dense rows)
    r = cfg.kv_lora_rank
    torch.testing.assert_close(attn.attend_absorbed(q_nope, q_pe, latents[..., :r], latents[..., r:], mask,
                                                    latents=latents),
                               attn.attend_absorbed(q_nope, q_pe, c_kv, k_pe, mask), atol=1e-5, rtol=1e-5)


def test_absorbed_in_chunks_of_sequences_equals_one_chunk(monkeypatch):
    """attend_absorbed's loop over chunks of sequences (one per chunk here) against a single chunk, with
    a per-sequence padding mask as serving's decode rows have; and the fused attention over [c_kv | k_pe]
    (serving's dense rows) against both, for one query per sequence and for several (a 4-D mask)."""
    import seekforge.model.model as model_module

    cfg = preset("tiny")
    attn = build_model(cfg).layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    b, nh, r, dr = 5, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    lens = torch.tensor([3, 11, 7, 2, 9])
    latents = torch.randn(b, 11, r + dr, generator=gen)
    for t in (1, 2):
        q_nope = torch.randn(b, t, nh, cfg.qk_nope_head_dim, generator=gen)
        q_pe = torch.randn(b, t, nh, dr, generator=gen)
        # query j of sequence i sees its first lens[i] - t + 1 + j tokens (decode rows: t = 1)
        mask = (torch.arange(11) < (lens - t + 1)[:, None, None] + torch.arange(t)[:, None])[:, None]  # (B, 1, T, S)
        args = (q_nope, q_pe, latents[..., :r], latents[..., r:], mask)
        with torch.no_grad():
            one = attn.attend_absorbed(*args)
            fused = attn.attend_absorbed(*args, latents=latents)
            monkeypatch.setattr(model_module, "SCORES_CHUNK_BYTES", 1)  # one sequence per chunk
            chunked = attn.attend_absorbed(*args)
            monkeypatch.undo()
        torch.testing.assert_close(chunked, one, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused, one, rtol=1e-5, atol=1e-5)


def test_packed_documents_equal_separate_runs():
    cfg = preset("tiny")
    model = build_model(cfg).eval()
    a, b = torch.randint(0, cfg.vocab_size, (1, 7)), torch.randint(0, cfg.vocab_size, (1, 9))
    packed = model(torch.cat([a, b], 1), positions=torch.cat([torch.arange(7), torch.arange(9)])[None],
                   segment_ids=torch.tensor([[0] * 7 + [1] * 9]))
    torch.testing.assert_close(packed, torch.cat([model(a), model(b)], 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("segments", [[[0] * 7 + [1] * 9], [[0] * 16], [[0, 1, 1, 2, 2, 2] + [3] * 10,
                                                                 [5] * 3 + [6] * 13]])
def test_document_layout_attention_equals_dense_mask(segments):
    """Attention over the padded per-document layout equals the block-diagonal mask over whole rows,
    forward and backward (rows of different document counts, one-token documents, one document), also
    with the documents laid out longer than the longest (round_len: what oneDNN's shapes get)."""
    cfg = preset("tiny")
    attn = build_model(cfg).layers[0].self_attn
    segment_ids = torch.tensor(segments)
    b, t, nh = *segment_ids.shape, cfg.num_attention_heads
    inputs = [torch.randn(b, t, nh, cfg.qk_nope_head_dim), torch.randn(b, t, nh, cfg.qk_rope_head_dim),
              torch.randn(b, t, cfg.kv_lora_rank), torch.randn(b, t, cfg.qk_rope_head_dim)]
    results = []
    for mask in (document_mask(segment_ids), DocumentLayout(segment_ids), DocumentLayout(segment_ids, lambda n: n + 3)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = attn.attend_naive(*leaves, mask=mask, is_causal=True)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append([out.detach(), *(x.grad for x in leaves), attn.kv_b_proj.weight.grad.clone()])
        attn.kv_b_proj.weight.grad = None
    for layout in results[1:]:
        for layout_value, dense_value in zip(layout, results[0], strict=True):
            torch.testing.assert_close(layout_value, dense_value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_naive_attention_equals_matmul_attention(dtype, tol):
    """attend_naive's inference path on PyTorch's fused kernel (v zero-padded to the qk width) against the
    batched matmuls it replaces: causal, a cached prefix's mask, and packed documents. bf16 within bf16's
    rounding: the matmul path rounds its scores and probabilities to bf16, the fused kernel keeps fp32."""
    cfg = preset("tiny")
    attn = build_model(cfg).layers[0].self_attn.to(dtype)
    gen = torch.Generator().manual_seed(0)
    nh, dr = cfg.num_attention_heads, cfg.qk_rope_head_dim
    t, s = 6, 10

    def inputs(b, t, s):
        shapes = [(b, t, nh, cfg.qk_nope_head_dim), (b, t, nh, dr), (b, s, cfg.kv_lora_rank), (b, s, dr)]
        return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]

    cases = [(inputs(2, t, t), {"is_causal": True}),
             (inputs(1, t, s), {"mask": torch.ones(t, s, dtype=torch.bool).tril(s - t)}),
             (inputs(1, 12, 12), {"mask": DocumentLayout(torch.tensor([[0] * 5 + [1] * 7]), lambda n: n + 2)})]
    with torch.inference_mode():
        for args, kwargs in cases:
            fused = attn.attend_naive(*args, **kwargs, fused=True)
            torch.testing.assert_close(fused, attn.attend_naive(*args, **kwargs), atol=tol, rtol=tol)


def test_meta_init_allocates_nothing():
    model = build_model(preset("v3-671b"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    counts = preset("v3-671b").num_params()
    buffers = sum(m.gate.e_score_correction_bias.numel() for m in model.moe_layers())
    assert n + buffers == counts["total"] + counts["mtp"]


def test_mtp_loss_trains_mtp_module():
    from seekforge.model.loss import lm_loss

    cfg = preset("tiny")
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    loss, metrics = lm_loss(model, ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert "mtp_loss" in metrics and model.mtp[0].eh_proj.weight.grad.abs().sum() > 0
