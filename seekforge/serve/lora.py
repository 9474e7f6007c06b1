"""Multi-LoRA serving: adapters in PEFT's format, any mix of them (and the base model) in one batch.

An adapter is a PEFT directory: `adapter_config.json` (r, lora_alpha, target_modules, use_rslora) and
`adapter_model.safetensors`, whose keys are PEFT's names for transformers' DeepseekV3ForCausalLM:
    base_model.model.model.layers.{i}.self_attn.q_a_proj.lora_A.weight    A (r, in)
    base_model.model.model.layers.{i}.self_attn.q_a_proj.lora_B.weight    B (out, r)
Our module names are HF's without the leading "model.", so loading is a rename. A LoRA linear is
W x + scale · B A x, scale = lora_alpha / r (lora_alpha / √r with rsLoRA).

Batching (the segment form of punica's SGMV): every linear an adapter may target carries one forward
hook. Before each forward the runner sets this step's adapters and, per flat token, which one it uses
(`token_adapter` (T,), -1 = base); each hook adds scale · (x_a Aᵀ) Bᵀ to the rows x_a of each adapter
present — two small matmuls per adapter in the batch, the base rows untouched.

MLA's absorbed decode never calls kv_b_proj: it folds kv_b_proj.weight into q and the output
(model.MLA.attend_absorbed). So for decode rows of an adapter that targets kv_b_proj, the paged cache
runs the absorbed path with that adapter's merged weight W + scale · B A (`kv_b_weight`, merged per
step and layer: exact, and no per-adapter copy of the weight kept). q_proj / q_a / q_b /
kv_a_proj_with_mqa / o_proj are plain linears on both paths, so their hooks apply as they are.
Routed experts (one fused parameter per layer), embeddings, the head and the MTP modules take no
LoRA; PEFT on transformers' DeepseekV3 targets the same linears.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from seekforge.model.model import Transformer
from seekforge.quant.linear import QuantLinear

_KEY = re.compile(r"^base_model\.model\.model\.(layers\.\d+\..+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_ids = itertools.count(1)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module name → (A (r, in), B (out, r), scale)
    lora_id: int  # unique per load: part of the prefix-cache key, so a reloaded adapter never hits stale blocks


def load_adapter(name: str, path: str, model: Transformer) -> LoRAAdapter:
    """Read a PEFT LoRA directory for `model`; ValueError (with the fix) for what we cannot serve."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / "adapter_config.json").is_file() or not (root / "adapter_model.safetensors").is_file():
        raise ValueError(f"LoRA {name!r}: {path!r} needs adapter_config.json and adapter_model.safetensors "
                         "(save it with peft's save_pretrained)")
    config = json.loads((root / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"LoRA {name!r}: only plain LoRA adapters are served (peft_type LORA, no DoRA)")
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA {name!r}: bias={config.get('bias')!r} / fan_in_fan_out are not supported; "
                         "train with bias='none'")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    linears = dict(model.named_modules())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    for key, tensor in load_file(root / "adapter_model.safetensors").items():
        match = _KEY.match(key)
        module = match and match[1]
        if isinstance(linears.get(module), QuantLinear):
            raise ValueError(f"LoRA {name!r}: {module} is quantized in this checkpoint; adapters are served over "
                             "full-precision weights only: serve the checkpoint this one was quantized from")
        if module is None or not isinstance(linears.get(module), nn.Linear):
            raise ValueError(f"LoRA {name!r}: weight {key!r} targets no linear of this model; adapters must "
                             "target q_proj/q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj/o_proj or dense/"
                             "shared-expert MLP projections of transformers' DeepseekV3ForCausalLM")
        parts.setdefault(module, {})[match[2]] = tensor.to(device, dtype)
    weights = {}
    for module, ab in parts.items():
        linear = linears[module]
        r = int(_pattern_value(config.get("rank_pattern") or {}, module, rank))
        module_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha))
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.shape != (r, linear.in_features) or b.shape != (linear.out_features, r):
            raise ValueError(f"LoRA {name!r}: {module} needs lora_A ({r}, {linear.in_features}) and lora_B "
                             f"({linear.out_features}, {r}); is the adapter for this model?")
        scale = module_alpha / math.sqrt(r) if config.get("use_rslora") else module_alpha / r
        weights[module] = (a, b, scale)
    return LoRAAdapter(name, str(path), rank, weights, next(_ids))


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key (a regex) matching the end of the
    module's name, else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class LoRAManager:
    """The loaded adapters by name, and the hooks that apply this step's ones."""

    def __init__(self, model: Transformer):
        self.model = model
        self.adapters: dict[str, LoRAAdapter] = {}
        self.step_adapters: list[LoRAAdapter] = []  # this step's adapters; token_adapter indexes them
        self.token_adapter: torch.Tensor | None = None  # (T,) int64, -1 = base
        # Hook every linear an adapter may target once, up front: adding hooks to modules while the
        # engine thread runs a forward would race with it; a hook with no adapter this step returns at once.
        for name, module in model.named_modules():
            # kv_b_proj is applied in kv_cache.py (merged weights), as the absorbed path never calls it
            if name.startswith("layers.") and isinstance(module, nn.Linear) and not name.endswith("kv_b_proj"):
                module.register_forward_hook(self._hook(name))

    def add(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded; unload it first or "
                             "pick another name")
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forget the adapter; requests already running with it finish with it (they hold it)."""
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)

    def set_step(self, adapter_per_chunk: list[LoRAAdapter | None], tokens_per_chunk: list[int], device) -> None:
        """The runner's flat layout for the coming forward: per chunk (in flat order) its adapter and
        token count."""
        self.step_adapters = list({id(a): a for a in adapter_per_chunk if a is not None}.values())
        if not self.step_adapters:
            self.token_adapter = None
            return
        slot = {id(a): i for i, a in enumerate(self.step_adapters)}
        per_chunk = torch.tensor([-1 if a is None else slot[id(a)] for a in adapter_per_chunk])
        self.token_adapter = per_chunk.repeat_interleave(torch.tensor(tokens_per_chunk)).to(device)

    def clear_step(self) -> None:
        """After the forward: the hooks go quiet, so another engine sharing the model (a reference
        engine in a test, GRPO's trainer) is never touched by this one's adapters."""
        self.step_adapters, self.token_adapter = [], None

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if self.token_adapter is None:
                return None
            x = inputs[0].reshape(-1, inputs[0].shape[-1])  # (T, in); rows follow the flat token layout
            assert x.shape[0] == self.token_adapter.shape[0], (name, x.shape)
            out = output.reshape(-1, output.shape[-1]).clone()  # (T, out)
            for i, adapter in enumerate(self.step_adapters):
                lora = adapter.weights.get(name)
                if lora is None:
                    continue
                rows = (self.token_adapter == i).nonzero()[:, 0]
                a, b, scale = lora
                out.index_add_(0, rows, (x[rows] @ a.t()) @ b.t(), alpha=scale)
            return out.view(output.shape)
        return hook

    def merged_kv_b(self, kv_b_proj: nn.Linear, name: str, slot: int) -> torch.Tensor | None:
        """kv_b_proj's weight with this step's adapter `slot` merged in: W + scale · B A (out, r_kv), or None
        if that adapter leaves `name` alone."""
        adapter = self.step_adapters[slot] if slot >= 0 else None
        lora = adapter.weights.get(name) if adapter is not None else None
        if lora is None:
            return None
        a, b, scale = lora
        return kv_b_proj.weight + scale * (b @ a)

    def kv_b_groups(self, kv_b_proj: nn.Linear, name: str, row_adapter: torch.Tensor):
        """Decode rows (row_adapter (Nd,) = slot, -1 = base) → [(rows, merged kv_b weight)] for each adapter
        present that targets `name`; the absorbed path reruns those rows with it."""
        groups = []
        for slot in range(len(self.step_adapters)):
            rows = (row_adapter == slot).nonzero()[:, 0]
            weight = self.merged_kv_b(kv_b_proj, name, slot) if len(rows) else None
            if weight is not None:
                groups.append((rows, weight))
        return groups
