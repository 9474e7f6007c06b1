"""Quantized matmuls on CPU, each next to the dequantize-then-matmul reference it must equal.

Shape legend: M tokens, I in_features, O out_features, G groups.

  W8A8  — `torch._int_mm`: int8 × int8 → int32 with exact integer accumulation, then one float
          rescale by (token or tensor scale) × (channel scale). The reference dequantizes both
          sides to fp32 and runs an fp32 matmul: the two differ only by fp32 summation order.
          On CPUs without VNNI (AVX2) `_int_mm` saturates (see `int_mm_is_exact`); there the int8
          products are summed by an fp32 matmul instead.
  W4A16 — `torch.ops.aten._weight_int4pack_mm_for_cpu` (torch's own CPU int4 kernel, used by
          gpt-fast and torchao's CPU int4 layout): chosen over torchao because it ships with torch
          (no extra dependency, no CUDA-torch risk) and is what torchao itself calls on CPU. It
          dequantizes each group in registers as w = (u − 8) · scale + zero, with u = q + 8 the
          unsigned nibble; our (q − zp) · scale maps to zero = −zp · scale. It needs O % 16 == 0
          and I % group == 0; other shapes (and non-CPU devices) take the reference path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from seekforge.quant.schemes import quantize_activation

INT4_INNER_K_TILES = 2  # torch's int4 packing layout parameter (2, 4 or 8); 2 accepts the smallest I


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether this machine's `torch._int_mm` sums int8 products exactly. On CPU it is oneDNN's
    u8·s8 GEMM; without VNNI (AVX2 CPUs) that multiplies pairs with vpmaddubsw, which saturates at
    int16, so large products come out wrong (errors of ~3·10⁴ in 10⁶ on an AVX2 build). One probe
    of extreme values against an exact int64 matmul tells, once per process."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (8, 64), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=g)
    a[0], b[:, 0] = 127, -128  # pairs of extreme products: the first to saturate
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


def int8_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, I) int8 @ b (I, O) int8 → (M, O) int32: `torch._int_mm` where it is exact, else an fp32
    matmul of the same integers (exact while I·128² < 2²⁴, i.e. I ≤ 1024; beyond that within fp32
    rounding, as the reference path)."""
    if int_mm_is_exact():
        return torch._int_mm(a, b, out=out) if out is not None else torch._int_mm(a, b)
    result = torch.mm(a.float(), b.float()).round_().to(torch.int32)
    return out.copy_(result) if out is not None else result


def int8_matmul(x: torch.Tensor, qweight_t: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None) -> torch.Tensor:
    """x (M, I) float, qweight_t (I, O) int8, weight_scale (O,) fp32, input_scale (1,) or None (per
    token) → (M, O) in x's dtype."""
    xq, x_scale = quantize_activation(x, input_scale)
    acc = int8_mm(xq, qweight_t)  # (M, O) int32, exact
    return torch.mul(acc, x_scale * weight_scale).to(x.dtype)  # (M, 1)·(O,) → (M, O) rescale, one pass


def int8_grouped_matmul(x: torch.Tensor, qweights_t: list[torch.Tensor], weight_scale: torch.Tensor,
                        input_scale: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """Routed experts' W8A8: x (S, I) sorted by expert, qweights_t[e] (I, O) int8, weight_scale (E, O),
    input_scale (E,) static or None (per token), counts (E,) → (S, O) in x's dtype.

    The same numbers as int8_matmul expert by expert (per-token scales are per row; a static scale is
    repeated over its expert's rows): one activation quantization and one rescale for all rows, and
    only the int8 GEMM per expert, written in place. At batch-1 decode each call is a few
    microseconds of dispatch, so the per-expert path's 2 × top-k quantize/rescale rounds cost more
    than the GEMMs (benchmarks/int8_linear.py; BENCHMARKS.md)."""
    rows = None if input_scale is None else input_scale.float().repeat_interleave(counts)[:, None]  # (S, 1)
    xq, x_scale = quantize_activation(x, rows)
    acc = torch.empty(x.shape[0], weight_scale.shape[1], dtype=torch.int32)  # (S, O)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            int8_mm(xq[start:start + n], qweights_t[e], out=acc[start:start + n])
        start += n
    w_rows = weight_scale.repeat_interleave(counts, dim=0)  # (S, O): each row's expert's channel scales
    return torch.mul(acc, x_scale * w_rows).to(x.dtype)


def int8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """Same contract with the dequantized weight (O, I): fake-quantize x, fp32 matmul."""
    xq, x_scale = quantize_activation(x, input_scale)
    return ((xq.float() * x_scale) @ weight.float().t()).to(x.dtype)


def int4_pack(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, dtype: torch.dtype):
    """q (O, I) int8 in [−8, 7], scale / zero_point (O, G) → (packed weight, scales_and_zeros (G, O, 2))
    in the layout `_weight_int4pack_mm_for_cpu` reads; `dtype` is the activations' dtype."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8), INT4_INNER_K_TILES)
    zero = torch.zeros_like(scale) if zero_point is None else -zero_point.float() * scale
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()


def int4_supported(x: torch.Tensor, out_features: int, in_features: int, group_size: int) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and out_features % 16 == 0
            and in_features % group_size == 0 and group_size in (32, 64, 128, 256))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (M, I) fp32/bf16 → (M, O)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group_size, scales_and_zeros)


def dequantized_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight-only reference: x (M, I) @ dequantized weight (O, I)ᵀ in x's dtype."""
    return F.linear(x, weight.to(x.dtype))
