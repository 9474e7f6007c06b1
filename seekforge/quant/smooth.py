"""SmoothQuant (Xiao et al. 2022, arXiv:2211.10438 §4): migrate activation outliers into weights.

For an RMSNorm whose output feeds linears W_k, per input channel j
    s_j = max|X_j|^α / max_k max_o |W_k[o, j]|^(1−α),
then norm.weight /= s and every consumer W_k[:, j] *= s_j: the block computes the same function
(exactly, up to rounding), with the channels the int8 activation grid struggles with flattened.

Where the migration goes (DeepSeek-V3 blocks), folded into the preceding RMSNorm's weight:
  input_layernorm           → q_a_proj (or q_proj), kv_a_proj_with_mqa
  q_a_layernorm             → q_b_proj
  post_attention_layernorm  → gate_proj, up_proj (dense); every routed expert's gate/up rows and the
                              shared experts' (MoE) — and the router's weight, which reads the same
                              normed input: it is rescaled too (not quantized) so routing is unchanged.
Not smoothed: o_proj and down_proj (their inputs come from attention / the SwiGLU product, no norm
to fold into; smoothing them would need a division inside the forward) and kv_b_proj (kept
weight-only under W8A8, see recipe.py). A group whose consumers are not all activation-quantized is
left alone.
"""

from __future__ import annotations

import torch
from torch import nn


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """act_absmax (I,), weights: (·, I) matrices reading that input → s (I,). Pure function."""
    w_absmax = torch.stack([w.float().abs().reshape(-1, w.shape[-1]).amax(dim=0) for w in weights]).amax(dim=0)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def smoothing_groups(block: nn.Module) -> list[tuple[str, list[str], list[str]]]:
    """(norm path, quantized consumer paths, rescaled-only paths) within one Block, as in the docstring.
    An expert entry is the stacked GroupedExperts parameter `mlp.experts.gate_up_proj`."""
    attn = block.self_attn
    q_in = "self_attn.q_proj" if hasattr(attn, "q_proj") else "self_attn.q_a_proj"
    groups = [("input_layernorm", [q_in, "self_attn.kv_a_proj_with_mqa"], [])]
    if hasattr(attn, "q_a_layernorm"):
        groups.append(("self_attn.q_a_layernorm", ["self_attn.q_b_proj"], []))
    mlp = block.mlp
    if hasattr(mlp, "experts"):
        consumers = ["mlp.experts.gate_up_proj"]
        if mlp.shared_experts is not None:
            consumers += ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"]
        groups.append(("post_attention_layernorm", consumers, ["mlp.gate.weight"]))
    else:
        groups.append(("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], []))
    return groups


def weight_of(block: nn.Module, path: str) -> torch.Tensor:
    """A consumer's weight: a linear's `.weight`, or a parameter named by its path."""
    try:
        return block.get_submodule(path).weight
    except AttributeError:  # not a module: a parameter path
        return block.get_parameter(path)


def consumer_scheme(prefix: str, path: str, plan: dict):
    """The plan's scheme for a consumer path of smoothing_groups (stacked experts: expert 0's
    gate_proj — recipe.resolve keeps a layer's experts all alike), or None when not quantized."""
    if path.endswith("experts.gate_up_proj"):
        return plan.get(f"{prefix}{path.removesuffix('.gate_up_proj')}.0.gate_proj")
    return plan.get(prefix + path)


@torch.no_grad()
def apply_smoothing(block: nn.Module, norm_path: str, consumers: list[str], rescaled: list[str],
                    act_absmax: torch.Tensor, alpha: float) -> None:
    fold_scales(block, norm_path, consumers + rescaled,
                smoothing_scales(act_absmax, [weight_of(block, p) for p in consumers], alpha))


@torch.no_grad()
def fold_scales(block: nn.Module, norm_path: str, readers: list[str], s: torch.Tensor) -> None:
    """norm.weight ÷ s and every reader's weight × s along its input dim: the block's function is unchanged."""
    norm = block.get_submodule(norm_path)
    norm.weight.copy_((norm.weight.float() / s).to(norm.weight.dtype))
    for path in readers:
        w = weight_of(block, path)
        w.copy_((w.float() * s).to(w.dtype))  # scales the last (input) dim, stacked experts included
