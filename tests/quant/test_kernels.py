"""Each quantized linear's kernel path equals its dequantize-then-matmul reference, and our integer
math equals compressed-tensors' (the library that defines the checkpoint format)."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams

from seekforge.quant.linear import QuantExperts, QuantLinear
from seekforge.quant.schemes import SCHEMES, W8A16, dequantize_weight, rtn, with_group_size

SCHEME_CASES = ["w8a8-dynamic", "w8a8-static", "w4a16", "w4a16-asym", "w8a16"]


def make(name, out_features=96, in_features=128, group_size=32, outlier=True):
    scheme = W8A16 if name == "w8a16" else with_group_size(SCHEMES[name], group_size)
    w = torch.randn(out_features, in_features) * 0.05
    if outlier:
        w[:, 3] *= 20  # an outlier channel
    q, scale, zp = rtn(w, scheme.weights)
    return QuantLinear.from_quantized(scheme, q, scale, zp, torch.tensor([0.03])), w


@pytest.mark.parametrize("name", SCHEME_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_dequantize_then_matmul(name, dtype):
    linear, _ = make(name)
    for m in (1, 7, 64):
        x = torch.randn(m, 128, dtype=dtype)
        fast, ref = linear.matmul(x), linear.reference(x)
        # fp32: exact integer accumulation (int8) or fp32 dequantization (int4) vs an fp32 matmul differ
        # only in summation order. bf16: the int4 kernel rounds scales and its output to bf16.
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        scale = ref.float().abs().max()
        assert (fast.float() - ref.float()).abs().max() <= tol * scale, (name, dtype, m)


def test_int8_kernel_is_used_and_int4_kernel_is_used():
    """The fast paths are not silently the reference: their layouts are built."""
    for name, key in (("w8a8-dynamic", "int8"), ("w4a16", ("int4", torch.float32))):
        linear, _ = make(name)
        linear(torch.randn(3, 128))
        assert key in linear._kernel_cache


def test_quantized_linear_is_close_to_the_float_linear():
    for name, bound in (("w8a8-dynamic", 0.02), ("w4a16", 0.15)):
        linear, w = make(name, outlier=False)
        x = torch.randn(16, 128)
        ref = x @ w.t()
        assert (linear(x) - ref).norm() / ref.norm() < bound


@pytest.mark.parametrize("name", ["w8a8-dynamic", "w4a16", "w4a16-asym"])
def test_our_qparams_and_dequantization_equal_compressed_tensors(name):
    scheme = with_group_size(SCHEMES[name], 32)
    args = QuantizationArgs(**{k: v for k, v in scheme.weights.to_config().items() if k != "observer_kwargs"})
    w = torch.randn(48, 64)
    q, scale, zp = rtn(w, scheme.weights)
    groups = w.view(48, -1, 32) if scheme.weights.strategy == "group" else w.view(48, 1, 64)
    ct_scale, ct_zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(zp.to(ct_zp.dtype), ct_zp)
    ct_q = quantize(w, ct_scale, ct_zp, args, dtype=torch.int8)
    assert torch.equal(q, ct_q)
    ct_w = dequantize(ct_q, ct_scale, ct_zp if not scheme.weights.symmetric else None, args)
    assert torch.equal(dequantize_weight(q, scale, None if scheme.weights.symmetric else zp, scheme.weights), ct_w)


def make_experts(name, experts=4, hidden=64, inter=32):
    scheme = with_group_size(SCHEMES[name], 32)

    def linear(o, i):
        return QuantLinear.from_quantized(scheme, *rtn(torch.randn(o, i), scheme.weights),
                                          torch.rand(1) * 0.05 + 0.01)  # input scale: used by w8a8-static

    return QuantExperts([linear(2 * inter, hidden) for _ in range(experts)], [linear(hidden, inter)
                                                                             for _ in range(experts)])


def test_quant_experts_equal_per_expert_reference():
    module = make_experts("w4a16")
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(int(counts.sum()), 64)
    out = module(x, counts)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        g, u = (rows @ module.gate_up[e].weight.t()).chunk(2, dim=-1)
        ref = (torch.nn.functional.silu(g) * u) @ module.down[e].weight.t()
        torch.testing.assert_close(out[start:start + n], ref, rtol=1e-4, atol=1e-4)
        start += n


@pytest.mark.parametrize("name", ["w8a8-dynamic", "w8a8-static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [1, 0, 1, 1], [3, 0, 5, 1]])  # batch-1 decode: 1 row each
def test_grouped_int8_experts_equal_the_per_expert_path_and_the_reference(name, dtype, counts):
    """One quantize/rescale for all experts' rows gives the per-expert int8 path's numbers exactly
    (per-token and per-expert scales are per row), and dequantize-then-matmul within 1e-5 of the
    output's max in fp32 (integer accumulation vs fp32 summation order) and 2e-2 in bf16 (the
    SwiGLU between the two projections runs in bf16 and its rounding can move an int8 step)."""
    module, counts = make_experts(name), torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 64, dtype=dtype)
    fast = module(x, counts)
    assert "int8" in module._kernel_cache  # the grouped path ran
    assert torch.equal(fast, module.per_expert(x, counts))
    start, ref = 0, torch.empty_like(x)
    for e, n in enumerate(counts.tolist()):
        g, u = module.gate_up[e].reference(x[start:start + n]).chunk(2, dim=-1)
        ref[start:start + n] = module.down[e].reference(torch.nn.functional.silu(g) * u)
        start += n
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fast.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


@pytest.mark.parametrize("exact", [True, False])
def test_int8_mm_is_exact_on_either_path(monkeypatch, exact):
    """int8_mm sums int8 products exactly whichever path this machine takes: `torch._int_mm` where it
    is exact (VNNI), the fp32 fallback where `_int_mm` saturates (AVX2). Both paths run here."""
    from seekforge.quant import kernels

    if exact and not kernels.int_mm_is_exact():
        pytest.skip("this CPU's torch._int_mm saturates (no VNNI): only the fallback runs here")
    monkeypatch.setattr(kernels, "int_mm_is_exact", lambda: exact)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-128, 128, (17, 1024), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (1024, 40), dtype=torch.int8, generator=g)
    a[0], b[:, 0] = 127, -128  # the extreme products a saturating int16 pair sum gets wrong
    want = (a.long() @ b.long()).int()
    assert torch.equal(kernels.int8_mm(a, b), want)
    out = torch.empty(17, 40, dtype=torch.int32)
    assert kernels.int8_mm(a, b, out=out) is out and torch.equal(out, want)
