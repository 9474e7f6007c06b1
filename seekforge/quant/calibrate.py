"""Quantize a built model by a recipe: sequential, layer-by-layer calibration (llm-compressor's
sequential pipeline), then module swaps.

For each decoder layer in turn, with the hidden states of all N calibration samples at its input:
  1. (SmoothQuant) one pass for per-channel input max of each smoothed norm's output; fold the scales;
  2. one pass with hooks gathering each target's input statistics — |x| max (static activation
     scales) and, for GPTQ, the Hessian 2/n·Σ x xᵀ; routed experts get theirs from only the tokens
     the router sent them;
  3. quantize and swap in QuantLinear / QuantExperts;
  4. run the quantized layer to produce the next layer's inputs (so later layers calibrate on
     the activations they will see).
Memory stays at one layer's activations for the N samples plus the layer's statistics.
An expert no calibration token reached falls back to RTN (and, under static activations, to the
largest input scale of its layer's other experts); the report lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from seekforge.model.moe import GroupedExperts
from seekforge.quant.awq import awq_block
from seekforge.quant.gptq import accumulate_hessian, gptq_quantize
from seekforge.quant.linear import QuantExperts, QuantLinear
from seekforge.quant.recipe import Recipe, resolve
from seekforge.quant.schemes import Scheme, qparams, rtn
from seekforge.quant.smooth import apply_smoothing, consumer_scheme, smoothing_groups


@dataclass
class InputStats:
    """One quantization unit's calibration inputs (a linear, or one expert's gate_up / down)."""

    rows: int = 0
    absmax: float = 0.0
    hessian: torch.Tensor | None = None

    def add(self, x: torch.Tensor, with_hessian: bool) -> None:
        x = x.reshape(-1, x.shape[-1])  # (n, I)
        if x.shape[0] == 0:
            return
        self.absmax = max(self.absmax, float(x.abs().max()))
        if with_hessian:
            if self.hessian is None:
                self.hessian = torch.zeros(x.shape[-1], x.shape[-1])
            self.rows = accumulate_hessian(self.hessian, self.rows, x)
        else:
            self.rows += x.shape[0]


@dataclass
class QuantReport:
    schemes: dict[str, str] = field(default_factory=dict)  # HF name → scheme name
    rtn_fallback: list[str] = field(default_factory=list)  # experts no calibration token reached
    expert_rows: list[int] = field(default_factory=list)  # calibration rows each routed expert received
    smoothed: list[str] = field(default_factory=list)  # "norm → consumers"

    def summary(self) -> str:
        by_scheme: dict[str, int] = {}
        for s in self.schemes.values():
            by_scheme[s] = by_scheme.get(s, 0) + 1
        lines = [f"quantized {len(self.schemes)} linear(s): " + ", ".join(f"{n} × {s}" for s, n in by_scheme.items())]
        if self.smoothed:
            lines.append(f"SmoothQuant folded into {len(self.smoothed)} norm(s), e.g. {self.smoothed[0]}")
        if self.expert_rows:
            reached = sorted(n for n in self.expert_rows if n) or [0]
            lines.append(f"routed experts: {sum(n > 0 for n in self.expert_rows)} of {len(self.expert_rows)} received "
                         f"calibration tokens and were calibrated on their own (rows per expert: min {reached[0]}, "
                         f"median {reached[len(reached) // 2]}, max {reached[-1]}); "
                         f"{len(self.rtn_fallback)} fell back to RTN")
        if self.rtn_fallback:
            lines.append(f"{len(self.rtn_fallback)} expert(s) received no calibration token and use RTN: "
                         + ", ".join(self.rtn_fallback[:8]) + (" …" if len(self.rtn_fallback) > 8 else ""))
        return "\n".join(lines)


@torch.no_grad()
def quantize_model(model: nn.Module, recipe: Recipe, samples: list[torch.Tensor] | None = None,
                   progress: bool = True) -> QuantReport:
    """Quantize `model` in place. samples: token id tensors (T,), needed when recipe.needs_calibration."""
    plan = resolve(model, recipe)
    if recipe.needs_calibration and not samples:
        raise ValueError(f"recipe (scheme {recipe.scheme}, method {recipe.method}) needs calibration samples")
    model.eval()
    report = QuantReport()
    inputs = None
    if recipe.needs_calibration:
        inputs = []
        for ids in samples:
            cos, sin = model.rotary(torch.arange(ids.numel()))
            inputs.append((model.embed_tokens(ids[None]), cos, sin))  # (1, T, H), (T, dr/2) ×2
    bar = tqdm(model.layers, desc="calibrating" if inputs else "quantizing", unit="layer", disable=not progress)
    for i, block in enumerate(bar):
        prefix = f"model.layers.{i}."
        if inputs is not None and recipe.smoothing_strength is not None:
            smooth_block(block, prefix, plan, inputs, recipe.smoothing_strength, report)
        if recipe.method == "awq":
            awq_block(block, prefix, plan, inputs, recipe.quant_scheme.weights, report)
        stats = collect_stats(block, prefix, plan, inputs, recipe.method == "gptq") if inputs is not None else {}
        swap_block(block, prefix, plan, stats, recipe, report)
        if inputs is not None:
            inputs = [(block(x, cos, sin), cos, sin) for x, cos, sin in inputs]
    if "lm_head" in plan:  # outside every block: calibrated on the final norm's outputs
        stats = {}
        if inputs is not None:
            stats["lm_head"] = InputStats()
            for x, _, _ in inputs:
                stats["lm_head"].add(model.norm(x), recipe.method == "gptq")
        model.lm_head = quantize_linear(model.lm_head, plan["lm_head"], stats.get("lm_head"), recipe)
        report.schemes["lm_head"] = plan["lm_head"].name
    return report


def run_block(block: nn.Module, inputs) -> None:
    for x, cos, sin in inputs:
        block(x, cos, sin)


def smooth_block(block, prefix, plan, inputs, alpha, report) -> None:
    groups = [g for g in smoothing_groups(block)
              if all(getattr(consumer_scheme(prefix, p, plan), "input_activations", None) for p in g[1])]
    absmax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args, out):
            m = out.detach().float().reshape(-1, out.shape[-1]).abs().amax(dim=0)
            absmax[name] = torch.maximum(absmax[name], m) if name in absmax else m
        return record

    handles = [block.get_submodule(norm).register_forward_hook(hook(norm)) for norm, _, _ in groups]
    try:
        run_block(block, inputs)
    finally:
        for h in handles:
            h.remove()
    for norm, consumers, rescaled in groups:
        apply_smoothing(block, norm, consumers, rescaled, absmax[norm], alpha)
        report.smoothed.append(f"{prefix}{norm} → {', '.join(consumers)}")


def collect_stats(block, prefix, plan, inputs, with_hessian: bool) -> dict[str, InputStats]:
    """One pass over the samples; keys are HF linear names, and `…experts.E.gate_up` / `.down`."""
    stats: dict[str, InputStats] = {}
    handles = []
    for path, module in block.named_modules():
        hf = prefix + path
        if isinstance(module, nn.Linear) and hf in plan:
            stats[hf] = InputStats()
            handles.append(module.register_forward_pre_hook(
                lambda m, args, s=stats[hf]: s.add(args[0].detach(), with_hessian)))
        elif isinstance(module, GroupedExperts) and f"{hf}.0.gate_proj" in plan:
            # hooked, the MoE layer dispatches every batch through the module (MoE._plain_inference)
            handles.append(module.register_forward_pre_hook(
                lambda m, args, hf=hf: expert_stats(m, args[0], args[1], hf, stats, with_hessian)))
    try:
        run_block(block, inputs)
    finally:
        for h in handles:
            h.remove()
    return stats


def expert_stats(experts: GroupedExperts, x, counts, hf: str, stats: dict, with_hessian: bool) -> None:
    """x (S, H) sorted by expert: each expert's rows feed its gate_up; its SwiGLU output feeds its down."""
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n].float()  # (n, H)
        gate, up = F.linear(rows, experts.gate_up_proj[e].float()).chunk(2, dim=-1)
        stats.setdefault(f"{hf}.{e}.gate_up", InputStats()).add(rows, with_hessian)
        stats.setdefault(f"{hf}.{e}.down", InputStats()).add(F.silu(gate) * up, with_hessian)
        start += n


def swap_block(block, prefix, plan, stats, recipe, report) -> None:
    for path, module in list(block.named_modules()):
        hf = prefix + path
        if isinstance(module, nn.Linear) and hf in plan:
            parent, attr = _parent(block, path)
            setattr(parent, attr, quantize_linear(module, plan[hf], stats.get(hf), recipe))
            report.schemes[hf] = plan[hf].name
        elif isinstance(module, GroupedExperts) and f"{hf}.0.gate_proj" in plan:
            parent, attr = _parent(block, path)
            setattr(parent, attr, quantize_experts(module, plan[f"{hf}.0.gate_proj"], hf, stats, recipe, report))


def _parent(block: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, attr = path.rpartition(".")
    return (block.get_submodule(parent) if parent else block), attr


def quantize_weight_by(weight: torch.Tensor, scheme: Scheme, stats: InputStats | None, recipe: Recipe):
    """→ (q, scale, zero_point, input_scale | None); GPTQ where a Hessian exists, RTN otherwise."""
    if recipe.method == "gptq" and stats is not None and stats.hessian is not None:
        q, scale, zp = gptq_quantize(weight, stats.hessian, scheme.weights, recipe.dampening_frac,
                                     recipe.actorder, recipe.block_size)
    else:
        q, scale, zp = rtn(weight, scheme.weights)
    act = scheme.input_activations
    input_scale = None
    if act is not None and not act.dynamic:
        amax = torch.tensor(stats.absmax if stats is not None and stats.rows else 0.0)
        input_scale = qparams(-amax, amax, act)[0].reshape(1)
    return q, scale, zp, input_scale


def quantize_linear(linear: nn.Linear, scheme: Scheme, stats: InputStats | None, recipe: Recipe) -> QuantLinear:
    q, scale, zp, input_scale = quantize_weight_by(linear.weight, scheme, stats, recipe)
    return QuantLinear.from_quantized(scheme, q, scale, zp, input_scale, linear.bias, linear.weight.dtype)


def quantize_experts(experts: GroupedExperts, scheme: Scheme, hf: str, stats: dict, recipe: Recipe,
                     report: QuantReport) -> QuantExperts:
    num_experts = experts.down_proj.shape[0]
    reached = [e for e in range(num_experts) if stats.get(f"{hf}.{e}.gate_up", InputStats()).rows > 0]
    if recipe.needs_calibration:
        report.expert_rows += [stats.get(f"{hf}.{e}.gate_up", InputStats()).rows for e in range(num_experts)]
    gate_up, down = [], []
    for e in range(num_experts):
        unit_stats = []
        for part in ("gate_up", "down"):
            s = stats.get(f"{hf}.{e}.{part}")
            if e not in reached and reached:  # fall back to the layer's widest calibrated input range
                s = InputStats(rows=1, absmax=max(stats[f"{hf}.{r}.{part}"].absmax for r in reached))
            unit_stats.append(s)
        if e not in reached and recipe.needs_calibration:
            report.rtn_fallback.append(f"{hf}.{e}")
        dtype = experts.down_proj.dtype
        gate_up.append(QuantLinear.from_quantized(scheme, *quantize_weight_by(experts.gate_up_proj[e], scheme,
                                                                              unit_stats[0], recipe), dtype=dtype))
        down.append(QuantLinear.from_quantized(scheme, *quantize_weight_by(experts.down_proj[e], scheme,
                                                                           unit_stats[1], recipe), dtype=dtype))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            report.schemes[f"{hf}.{e}.{proj}"] = scheme.name
    return QuantExperts(gate_up, down)
