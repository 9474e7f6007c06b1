"""AWQ (Lin et al. 2023, arXiv:2306.00978 §3.2): activation-aware per-channel weight scaling before
weight-only rounding, searched on calibration activations.

For an RMSNorm whose output x (n, I) feeds weights W (stacked consumers, (O, I)), AWQ tries
    s = mean|x|^r (r = 0, 1/grid, …), normalized so max(s)·min(s) = 1,
quantizes W·diag(s) (RTN with the recipe's scheme), and keeps the r whose Q(W·s)·(x/s) is closest to
W·x in mean squared error. The chosen s is folded exactly like SmoothQuant's (smooth.py): norm weight
÷ s, consumers (and the MoE router, which reads the same x) × s — then the weights are rounded.
The groups are smooth.py's norm → consumer groups (o_proj and down_proj are not scaled: no norm
precedes them). For a MoE layer the loss runs every token through every expert's gate/up rows (an
approximation: a token only meets its top-k experts).
"""

from __future__ import annotations

import torch
from torch import nn

from seekforge.quant.schemes import QuantArgs, dequantize_weight, rtn
from seekforge.quant.smooth import consumer_scheme, fold_scales, smoothing_groups, weight_of

MAX_TOKENS = 2048  # activations kept per group for the search


def awq_scales(x: torch.Tensor, weight: torch.Tensor, args: QuantArgs, grid: int = 20) -> torch.Tensor:
    """x (n, I), weight (O, I) → s (I,) minimizing ‖Q(W·s)·(x/s)ᵀ − W·xᵀ‖². Pure function."""
    x, w = x.float(), weight.float()
    reference = x @ w.t()  # (n, O)
    x_mean = x.abs().mean(dim=0)  # (I,)
    best, best_loss = torch.ones_like(x_mean), float("inf")
    for step in range(grid):
        s = x_mean.pow(step / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q, scale, zp = rtn(w * s, args)
        w_q = dequantize_weight(q, scale, None if args.symmetric else zp, args) / s
        loss = float((x @ w_q.t() - reference).pow(2).mean())
        if loss < best_loss:
            best, best_loss = s, loss
    return best


@torch.no_grad()
def awq_block(block: nn.Module, prefix: str, plan: dict, inputs, args: QuantArgs, report) -> None:
    """Search and fold AWQ scales for each norm → consumers group of one Block whose consumers the plan
    quantizes; `inputs` are the block's (x, cos, sin) calibration inputs."""
    groups = [g for g in smoothing_groups(block) if all(consumer_scheme(prefix, p, plan) for p in g[1])]
    seen: dict[str, list[torch.Tensor]] = {norm: [] for norm, _, _ in groups}

    def hook(name):
        def record(module, args_, out):
            kept = sum(t.shape[0] for t in seen[name])
            if kept < MAX_TOKENS:
                seen[name].append(out.detach().float().reshape(-1, out.shape[-1])[:MAX_TOKENS - kept])
        return record

    handles = [block.get_submodule(norm).register_forward_hook(hook(norm)) for norm, _, _ in groups]
    try:
        for x, cos, sin in inputs:
            block(x, cos, sin)
    finally:
        for h in handles:
            h.remove()
    for norm, consumers, rescaled in groups:
        weights = [weight_of(block, p).float() for p in consumers]
        s = awq_scales(torch.cat(seen[norm]), torch.cat([w.reshape(-1, w.shape[-1]) for w in weights]), args)
        fold_scales(block, norm, consumers + rescaled, s)
        report.smoothed.append(f"{prefix}{norm} → {', '.join(consumers)} (AWQ)")
