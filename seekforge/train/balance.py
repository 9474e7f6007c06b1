"""Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2, Wang et al. arXiv:2408.15664).

Each MoE layer adds a per-expert bias to the routing scores for *selection only*. After every
optimizer step the bias moves a fixed amount γ toward balance, by the sign of the load error:
    b_i ← b_i + γ · sign(mean_load − load_i)
so overloaded experts become less attractive. The loads are the global ones: summed over
micro-batches by the MoE layers (`tokens_per_expert`) and over data-parallel ranks here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def update_expert_bias(moe_layers, bias_update_speed: float, group=None) -> torch.Tensor | None:
    """Apply one bias update per MoE layer, reset the counts, and return each layer's load
    imbalance max/mean (1.0 = perfectly balanced) measured before the update: an (L,) fp32 tensor on
    the counts' device, read by the caller when it logs (no host sync here); None without MoE layers.

    group: the data-parallel process group to sum counts over; None = the default group when
    torch.distributed is initialized, else no communication.
    """
    if not moe_layers:
        return None
    # One all-reduce for all layers: stack the (E,) counts into (L, E).
    counts = torch.stack([m.tokens_per_expert.float() for m in moe_layers])  # (L, E)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    mean = counts.mean(dim=1, keepdim=True)  # (L, 1)
    imbalance = counts.amax(dim=1) / mean.squeeze(1).clamp_min(1e-9)
    step = bias_update_speed * torch.sign(mean - counts)  # (L, E)
    for layer, delta in zip(moe_layers, step, strict=True):
        bias = layer.gate.e_score_correction_bias
        bias += delta.to(bias.device, bias.dtype)
        layer.tokens_per_expert.zero_()
    return imbalance
