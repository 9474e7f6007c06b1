"""The routed experts of a decode-sized batch, for the GPU path: every (token, chosen expert) pair in two
kernels, as vLLM's and SGLang's `fused_moe`, instead of a sort, two gathers and a grouped GEMM per
projection around them.

`fused_moe` is the entry point; `fused_moe_reference` is its torch reference (the chosen experts' weights
gathered per token), sync-free too. Both equal MoE's dispatch → GroupedExperts.forward → combine: the
weighted sum of each token's K experts' SwiGLU outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor,
              indices: torch.Tensor) -> torch.Tensor:
    """x (N, H); stacked experts gate_up_proj (E, 2I, H) and down_proj (E, H, I) in x's dtype; router
    weights (N, K) fp32 and indices (N, K) int → (N, H) in x's dtype: Σ_k weights[n, k] ·
    down_e(silu(gate_e(x_n)) · up_e(x_n)), e = indices[n, k]."""
    return fused_moe_reference(x, gate_up_proj, down_proj, weights, indices)


def fused_moe_reference(x, gate_up_proj, down_proj, weights, indices) -> torch.Tensor:
    gate_up = torch.einsum("nh,nkoh->nko", x.float(), gate_up_proj[indices].float())  # (N, K, 2I)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # (N, K, I)
    out = torch.einsum("nki,nkhi->nkh", act, down_proj[indices].float())  # (N, K, H)
    return (out * weights[..., None]).sum(dim=1).to(x.dtype)
