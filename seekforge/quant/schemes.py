"""Quantization schemes and the integer math they share: pure functions on tensors.

Shape legend: O out_features, I in_features, G = I / group_size groups, M tokens.

The arithmetic mirrors the `compressed-tensors` library's (`calculate_qparams`, `quantize`,
`dequantize`) so a checkpoint we write dequantizes in any reader to exactly the weights we serve:
  symmetric:  scale = max|w| / ((qmax − qmin) / 2),   q = clamp(round(w / scale), qmin, qmax)
  asymmetric: scale = (max − min) / (qmax − qmin),     zp = clamp(round(qmin − min / scale), qmin, qmax)
              q = clamp(round(w / scale + zp), qmin, qmax)
  dequantize: w ≈ (q − zp) · scale   (zp = 0 when symmetric)
with min ≤ 0 ≤ max forced so zero is exact, and integers in the signed range [−2^(b−1), 2^(b−1) − 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantArgs:
    """One tensor's quantization: `compressed-tensors`' QuantizationArgs, the fields we use."""

    num_bits: int
    strategy: str  # "channel" | "group" (weights), "token" | "tensor" (activations)
    symmetric: bool = True
    group_size: int | None = None
    dynamic: bool = False  # activations: scales computed per call (True) or calibrated once (False)

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def to_config(self) -> dict:
        """The `weights` / `input_activations` entry of a compressed-tensors config group."""
        return {"num_bits": self.num_bits, "type": "int", "symmetric": self.symmetric, "strategy": self.strategy,
                "group_size": self.group_size, "dynamic": self.dynamic, "block_structure": None,
                "actorder": None, "observer": None if self.dynamic else "minmax", "observer_kwargs": {}}


@dataclass(frozen=True)
class Scheme:
    name: str
    weights: QuantArgs
    input_activations: QuantArgs | None = None  # None: weight-only

    @property
    def format(self) -> str:
        """compressed-tensors' storage format: int8 weights as is for W8A8, packed int32 otherwise."""
        return "int-quantized" if self.input_activations is not None else "pack-quantized"


SCHEMES = {
    "w8a8-dynamic": Scheme("w8a8-dynamic", QuantArgs(8, "channel"), QuantArgs(8, "token", dynamic=True)),
    "w8a8-static": Scheme("w8a8-static", QuantArgs(8, "channel"), QuantArgs(8, "tensor")),
    "w4a16": Scheme("w4a16", QuantArgs(4, "group", group_size=128)),
    "w4a16-asym": Scheme("w4a16-asym", QuantArgs(4, "group", symmetric=False, group_size=128)),
}
# kv_b_proj under a W8A8 scheme: int8 weights, no activation quantization (see recipe.py for why).
W8A16 = Scheme("w8a16", QuantArgs(8, "channel"))


def with_group_size(scheme: Scheme, group_size: int | None) -> Scheme:
    if group_size is None or scheme.weights.strategy != "group":
        return scheme
    weights = QuantArgs(scheme.weights.num_bits, "group", scheme.weights.symmetric, group_size)
    return Scheme(scheme.name, weights, scheme.input_activations)


# ------------------------------------------------------------------------------ weights
def grouped(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """w (O, I) → (O, G, I/G): per-channel is one group of I."""
    group = args.group_size if args.strategy == "group" else w.shape[-1]
    return w.reshape(w.shape[0], -1, group)


def weight_qparams(w: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """w (O, I) → scale (O, G) fp32, zero_point (O, G) int8, from each group's min and max."""
    g = grouped(w.float(), args)
    return qparams(g.amin(dim=-1), g.amax(dim=-1), args)


def qparams(min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    min_vals, max_vals = min_vals.clamp(max=0), max_vals.clamp(min=0)  # zero stays representable
    bit_range = float(args.qmax - args.qmin)
    if args.symmetric:
        scale = torch.maximum(min_vals.abs(), max_vals) / (bit_range / 2)
        zero_point = torch.zeros_like(scale)
    else:
        scale = (max_vals - min_vals) / bit_range
        zero_point = (args.qmin - min_vals / scale).clamp(args.qmin, args.qmax)
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)  # an all-zero group
    zero_point = torch.nan_to_num(zero_point).round().to(torch.int8)
    return scale, zero_point


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """w (O, I), scale / zero_point (O, G) → q (O, I) int8 in [qmin, qmax]."""
    g = grouped(w.float(), args)
    q = (g / scale[..., None] + zero_point[..., None].float()).round().clamp(args.qmin, args.qmax)
    return q.reshape(w.shape).to(torch.int8)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                      args: QuantArgs) -> torch.Tensor:
    """q (O, I) int8 → (q − zp) · scale (O, I) in scale's dtype, compressed-tensors' order of operations."""
    g = grouped(q, args).to(scale.dtype)
    if zero_point is not None:
        g = g - zero_point[..., None].to(scale.dtype)
    return (g * scale[..., None]).reshape(q.shape)


def rtn(w: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest: w (O, I) → q int8 (O, I), scale (O, G), zero_point (O, G)."""
    scale, zero_point = weight_qparams(w, args)
    return quantize_weight(w, scale, zero_point, args), scale, zero_point


# ------------------------------------------------------------------------------ activations
def quantize_activation(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, I) → int8 (M, I) and its fp32 scale: (M, 1) per token (dynamic), or the calibrated (1,) scale.
    Few kernels on purpose: at decode batch sizes these elementwise passes, not the int8 GEMM, are the cost."""
    if static_scale is None:
        absmax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # (M, 1)
        scale = absmax.clamp_(min=1e-8).div_(127.0)
        # |x| <= absmax, so |x / scale| <= 127 up to one rounding of the division: it rounds to at most
        # 127 and the clamp a static scale needs would be one more pass over x for nothing.
        return torch.div(x, scale).round_().to(torch.int8), scale
    scale = static_scale.float()  # (1,) or one per row (M, 1)
    return torch.div(x, scale).round_().clamp_(-128, 127).to(torch.int8), scale
