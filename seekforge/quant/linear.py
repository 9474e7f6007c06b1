"""The modules a recipe swaps in: QuantLinear for an nn.Linear, QuantExperts for the stacked experts.

Shape legend: O out_features, I in_features, G groups, E experts, S routed token copies.

Both hold integer weights and scales as buffers (what the checkpoint stores) and build the kernel's
layout (transposed int8, packed int4) lazily on first use, once per activation dtype. `weight` is
the dequantized weight: anything that reads a linear's weight directly — MLA's absorbed decode path
reads `kv_b_proj.weight` — sees exactly the weights the quantized forward multiplies by.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seekforge.quant import kernels
from seekforge.quant.schemes import Scheme, dequantize_weight


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, scheme: Scheme, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.dtype = dtype  # of `weight`: the model's compute dtype, as an nn.Linear's weight would be
        w = scheme.weights
        groups = in_features // w.group_size if w.strategy == "group" else 1
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, groups))
        self.register_buffer("weight_zero_point", None if w.symmetric else
                             torch.zeros(out_features, groups, dtype=torch.int8))
        act = scheme.input_activations
        self.register_buffer("input_scale", torch.ones(1) if act is not None and not act.dynamic else None)
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._kernel_cache: dict = {}

    @classmethod
    def from_quantized(cls, scheme: Scheme, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                       input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.float32) -> QuantLinear:
        module = cls(q.shape[1], q.shape[0], scheme, bias is not None, dtype)
        module.set_quantized(q, scale, zero_point, input_scale, bias)
        return module.to(q.device)

    @torch.no_grad()
    def set_quantized(self, q, scale, zero_point=None, input_scale=None, bias=None):
        self.qweight.copy_(q)
        self.weight_scale.copy_(scale.reshape(self.weight_scale.shape))
        if self.weight_zero_point is not None:
            self.weight_zero_point.copy_(zero_point.reshape(self.weight_zero_point.shape))
        if self.input_scale is not None:
            self.input_scale.copy_(input_scale.reshape(1))
        if self.bias is not None:
            self.bias.copy_(bias)
        self._kernel_cache.clear()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (O, I) in `dtype` (cached: MLA's absorbed path reads it every decode step)."""
        if "weight" not in self._kernel_cache:
            self._kernel_cache["weight"] = self.dequantized().to(self.dtype)
        return self._kernel_cache["weight"]

    def dequantized(self) -> torch.Tensor:
        """(q − zp) · scale (O, I) fp32: the weights the checkpoint describes."""
        return dequantize_weight(self.qweight, self.weight_scale, self.weight_zero_point, self.scheme.weights)

    def _apply(self, fn, recurse=True):  # .to() / .cuda(): the cached layouts belong to the old tensors
        self._kernel_cache = {}
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, I)
        y = self.matmul(x2) if x.device.type == "cpu" else self.reference(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel path; `reference` is what it must equal (tests/quant/test_kernels.py)."""
        w, act = self.scheme.weights, self.scheme.input_activations
        if act is not None:
            if "int8" not in self._kernel_cache:
                self._kernel_cache["int8"] = (self.qweight.t().contiguous(), self.weight_scale.view(-1).float())
            qweight_t, scale = self._kernel_cache["int8"]
            return kernels.int8_matmul(x, qweight_t, scale, self.input_scale)
        if w.num_bits == 4 and kernels.int4_supported(x, self.out_features, self.in_features, w.group_size):
            key = ("int4", x.dtype)
            if key not in self._kernel_cache:
                self._kernel_cache[key] = kernels.int4_pack(self.qweight, self.weight_scale.float(),
                                                            self.weight_zero_point, x.dtype)
            packed, scales_and_zeros = self._kernel_cache[key]
            return kernels.int4_matmul(x, packed, scales_and_zeros, w.group_size)
        return self.reference(x)  # int8 weight-only (kv_b_proj under W8A8) and shapes int4 cannot take

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.input_activations is not None:
            return kernels.int8_matmul_reference(x, self.dequantized(), self.input_scale)
        key = ("dequantized", x.dtype)
        if key not in self._kernel_cache:
            self._kernel_cache[key] = self.dequantized().to(x.dtype)
        return F.linear(x, self._kernel_cache[key])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


class QuantExperts(nn.Module):
    """GroupedExperts with each expert's projections as QuantLinears: `gate_up[e]` (2I, H) with gate
    rows first, as GroupedExperts stacks them, and `down[e]` (H, I). Each expert has its own scales
    (and, for static activations, its own input scale from the tokens routed to it)."""

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear]):
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self._kernel_cache: dict = {}

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (S, H) sorted by expert → (S, H); experts that received no token are skipped."""
        if x.device.type == "cpu" and self.gate_up[0].scheme.input_activations is not None:
            return self.int8_forward(x, num_tokens_per_expert)
        return self.per_expert(x, num_tokens_per_expert)

    def int8_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """W8A8 with every expert's rows in one quantize and one rescale (kernels.int8_grouped_matmul);
        `per_expert` is what it must equal."""
        if "int8" not in self._kernel_cache:
            self._kernel_cache["int8"] = [self._int8_layout(self.gate_up), self._int8_layout(self.down)]
        (gu_q, gu_scale, gu_in), (down_q, down_scale, down_in) = self._kernel_cache["int8"]
        gate, up = kernels.int8_grouped_matmul(x, gu_q, gu_scale, gu_in, num_tokens_per_expert).chunk(2, dim=-1)
        return kernels.int8_grouped_matmul(F.silu(gate) * up, down_q, down_scale, down_in, num_tokens_per_expert)

    @staticmethod
    def _int8_layout(linears: nn.ModuleList):
        """→ ([qweight_t (I, O)] per expert, weight scales (E, O), static input scales (E,) or None)."""
        static = linears[0].input_scale is not None
        return ([m.qweight.t().contiguous() for m in linears],
                torch.stack([m.weight_scale.view(-1).float() for m in linears]),
                torch.cat([m.input_scale.float() for m in linears]) if static else None)

    def _apply(self, fn, recurse=True):  # the stacked layouts belong to the old tensors
        self._kernel_cache = {}
        return super()._apply(fn, recurse)

    def per_expert(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(num_tokens_per_expert.tolist()):
            if n:
                gate, up = self.gate_up[e](x[start:start + n]).chunk(2, dim=-1)  # (n, I) each
                out[start:start + n] = self.down[e](F.silu(gate) * up)
            start += n
        return out
