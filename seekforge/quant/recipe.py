"""Recipes: which scheme goes on which module, checked against a built model before any weight moves.

A recipe is a YAML file whose keys are `Recipe`'s fields, e.g.

    scheme: w4a16          # w8a8-dynamic | w8a8-static | w4a16 | w4a16-asym
    method: gptq           # rtn | gptq | awq
    targets: [Linear]      # "Linear" (every linear), a module name, a glob, or "re:<regex>"
    ignore: [lm_head, "re:.*mlp.gate$"]
    group_size: 32

Module names are the Hugging Face checkpoint's (`model.layers.3.self_attn.q_a_proj`, one name per
routed expert: `model.layers.3.mlp.experts.7.gate_proj`), the names llm-compressor's recipes and a
compressed-tensors `ignore` list use. As in llm-compressor, "re:" patterns are `re.match`ed; others
match exactly or as an `fnmatch` glob. MTP modules are never quantized (the engine does not run them).

MLA's kv_b_proj: its weight is used twice — by the naive path as a linear on c_kv, and by the
absorbed decode path, which folds it into q and the output (`MLA.kv_b_weights` reads
`kv_b_proj.weight`). QuantLinear.weight is the dequantized weight, so with weight-only schemes both
paths multiply by the same dequantized matrix and stay equal. The absorbed path has no place to
quantize the activation c_kv, so under a W8A8 scheme kv_b_proj gets the scheme's int8 weights
without activation quantization (W8A16) — both paths again use the same dequantized weight.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from torch import nn

from seekforge.config import read_config_file
from seekforge.model.hf import hf_name
from seekforge.model.moe import GroupedExperts
from seekforge.quant.schemes import SCHEMES, W8A16, Scheme, with_group_size

METHODS = ("rtn", "gptq", "awq")


@dataclass
class Recipe:
    scheme: str
    method: str = "rtn"  # rtn | gptq | awq (AWQ scales, then RTN)
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    group_size: int | None = None  # None: the scheme's (128 for w4a16)
    smoothing_strength: float | None = None  # SmoothQuant α; None: 0.5 for w8a8-static, off otherwise
    dampening_frac: float = 0.01  # GPTQ: λ = frac · mean(diag H)
    actorder: bool = False  # GPTQ: columns by descending diag(H), groups fixed up front ("weight" actorder)
    block_size: int = 128  # GPTQ: columns updated lazily per block
    dataset: str = "builtin:text"  # or a JSONL file of {"text": ...}
    num_calibration_samples: int = 64
    max_seq_length: int = 256
    seed: int = 0

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unsupported scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        if self.method not in METHODS:
            raise ValueError(f"unsupported method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.method == "awq" and self.quant_scheme.input_activations is not None:
            raise ValueError(f"method awq scales weights for weight-only rounding; {self.scheme} quantizes "
                             "activations too: use w4a16 / w4a16-asym, or method rtn/gptq (SmoothQuant for W8A8)")
        if self.smoothing_strength is None and self.scheme == "w8a8-static":
            self.smoothing_strength = 0.5
        if self.smoothing_strength is not None:
            if self.quant_scheme.input_activations is None:
                raise ValueError(f"smoothing_strength is for W8A8 schemes (it moves activation outliers into "
                                 f"weights); {self.scheme} quantizes weights only: remove it")
            if not 0 <= self.smoothing_strength <= 1:
                raise ValueError(f"smoothing_strength={self.smoothing_strength}: SmoothQuant's α lies in [0, 1]")
        if self.group_size is not None and self.quant_scheme.weights.strategy != "group":
            raise ValueError(f"group_size is for grouped schemes (w4a16*); {self.scheme} is per channel: remove it")
        for key in ("num_calibration_samples", "max_seq_length", "block_size", "group_size"):
            if key == "group_size" and self.group_size is None:
                continue
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r}: give a positive integer")
        if not self.targets:
            raise ValueError("targets is empty; name the modules to quantize, e.g. [Linear]")

    @property
    def quant_scheme(self) -> Scheme:
        return with_group_size(SCHEMES[self.scheme], self.group_size)

    @property
    def needs_calibration(self) -> bool:
        act = self.quant_scheme.input_activations
        return self.method != "rtn" or self.smoothing_strength is not None or (act is not None and not act.dynamic)

    @classmethod
    def from_file(cls, path: str | Path) -> Recipe:
        data = read_config_file(path, "Recipe fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"recipe {path}: unknown key(s) {unknown}; the keys are {sorted(known)}")
        if "scheme" not in data:
            raise ValueError(f"recipe {path} names no scheme; add e.g. `scheme: w8a8-dynamic`")
        return cls(**data)


# ------------------------------------------------------------------------------ names
def module_names(model: nn.Module) -> dict[str, str]:
    """HF name → our module path, for every module (experts listed one by one, as `…experts.E.proj`)."""
    names = {}
    for name, module in model.named_modules():
        if not name or name.startswith("mtp."):
            continue
        hf = hf_name(name + ".weight", model.cfg).removesuffix(".weight")
        names[hf] = name
        if isinstance(module, GroupedExperts):
            for e in range(module.down_proj.shape[0]):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    names[f"{hf}.{e}.{proj}"] = f"{name}.{e}.{proj}"
    return names


def quantizable(model: nn.Module) -> list[str]:
    """HF names of the linears a recipe may target: every nn.Linear and every routed expert projection."""
    names = module_names(model)
    return [hf for hf, name in names.items()
            if re.search(r"\.experts\.\d+\.\w+_proj$", hf) or isinstance(model.get_submodule(name), nn.Linear)]


def matches(pattern: str, name: str) -> bool:
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def resolve(model: nn.Module, recipe: Recipe) -> dict[str, Scheme]:
    """HF name → scheme for every module the recipe quantizes. Raises ValueError (before any weight is
    touched) for a pattern that names nothing, a group size that does not divide a target's
    in_features, or experts of one layer that the recipe would quantize only in part."""
    candidates, every = quantizable(model), module_names(model)
    for pattern in recipe.targets:
        if not any(matches(pattern, n) for n in candidates):
            raise ValueError(f"recipe target {pattern!r} matches no linear module of this model "
                             f"(e.g. {candidates[0]!r}); fix the name or pattern (regexes start with 're:')")
    for pattern in recipe.ignore:
        if pattern != "Linear" and not any(matches(pattern, n) for n in every):
            raise ValueError(f"recipe ignore entry {pattern!r} matches no module of this model; fix or remove it")
    scheme = recipe.quant_scheme
    plan = {}
    for name in candidates:
        if any(matches(p, name) for p in recipe.ignore) or not any(matches(p, name) for p in recipe.targets):
            continue
        weight_only_kv_b = name.endswith("self_attn.kv_b_proj") and scheme.input_activations is not None
        plan[name] = W8A16 if weight_only_kv_b else scheme
    check_plan(model, plan, every)
    return plan


def check_plan(model: nn.Module, plan: dict[str, Scheme], every: dict[str, str]) -> None:
    for name, scheme in plan.items():
        w = scheme.weights
        in_features = in_features_of(model, every, name)
        if w.strategy == "group" and in_features % w.group_size:
            raise ValueError(f"group_size={w.group_size} does not divide {name}'s in_features={in_features}; "
                             f"set group_size (--group-size, or the recipe's group_size) to a divisor of every "
                             f"target's in_features (e.g. 32), or ignore {name}")
    experts: dict[str, set[str]] = {}
    for hf in every:
        m = re.fullmatch(r"(.+\.experts)\.\d+\.\w+_proj", hf)
        if m:
            experts.setdefault(m[1], set()).add(hf)
    for layer, names in experts.items():
        chosen = {n for n in names if n in plan}
        if chosen and (chosen != names or len({plan[n] for n in names}) > 1):
            raise ValueError(f"the recipe quantizes only some of {layer}'s routed experts, or gives them different "
                             f"schemes; they run as one module: target all of them alike or ignore all")


def in_features_of(model: nn.Module, every: dict[str, str], hf: str) -> int:
    m = re.fullmatch(r"(.+\.experts)\.\d+\.(\w+_proj)", hf)
    if m:
        experts = model.get_submodule(every[m[1]])
        return experts.down_proj.shape[-1] if m[2] == "down_proj" else experts.gate_up_proj.shape[-1]
    return model.get_submodule(every[hf]).in_features
