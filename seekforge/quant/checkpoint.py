"""Quantized checkpoints in the `compressed-tensors` format (what llm-compressor writes and vLLM /
SGLang load), written and read by our own code; the library itself is a test dependency only
(tests/quant/test_checkpoint.py decompresses our files with it and reads files its compressor wrote).

A checkpoint is an HF directory: config.json gains `quantization_config`
    {"quant_method": "compressed-tensors", "format": "int-quantized" | "pack-quantized" | "mixed-precision",
     "quantization_status": "compressed", "config_groups": {"group_0": {"targets": ["Linear"],
     "weights": {...}, "input_activations": {...} | null, "format": ...}, ...}, "ignore": [names], ...}
and each quantized linear `NAME` is stored as
    int-quantized  (W8A8):  NAME.weight int8 (O, I), NAME.weight_scale (O, 1), NAME.input_scale (1,) if static
    pack-quantized (W4A16, W8A16): NAME.weight_packed int32 (O, I·b/32), NAME.weight_scale (O, G),
                    NAME.weight_shape int64 [O, I], NAME.weight_zero_point int32 (O·b/32, G) if asymmetric
Packing (compressed-tensors' pack_to_int32): values offset to unsigned (q + 2^(b−1)), element i of a row
at bit i·b of the row's int32 words; zero points pack the same way along the output dim.
Which group a module belongs to follows the library: an exact name beats a "re:" pattern beats a
class name ("Linear"); `ignore` wins over all. Scales are stored in fp32. One safetensors file.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from seekforge.config import ModelConfig
from seekforge.model.hf import (
    drop_absent_mtp,
    hf_config,
    hf_layout,
    materialize,
    open_shard,
    read_tensor,
    replace_dir,
    save_safetensors,
    shard_files,
)
from seekforge.model.moe import GroupedExperts
from seekforge.quant.linear import QuantExperts, QuantLinear
from seekforge.quant.recipe import matches, module_names, quantizable
from seekforge.quant.schemes import QuantArgs, Scheme

KV_B_TARGET = r"re:.*self_attn\.kv_b_proj$"


# ------------------------------------------------------------------------------ packing
def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """q (R, C) int8 → int32 (R, ⌈C·b/32⌉) (dim=1), or packed along rows (dim=0). b ∈ {4, 8}."""
    assert num_bits in (4, 8), num_bits
    if dim == 0:
        return pack_int32(q.t(), num_bits).t().contiguous()
    per_word = 32 // num_bits
    u = (q.to(torch.int64) + (1 << (num_bits - 1)))  # (R, C) unsigned
    pad = (-u.shape[1]) % per_word
    u = torch.nn.functional.pad(u, (0, pad)).view(u.shape[0], -1, per_word)  # (R, words, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    words = (u << shifts).sum(dim=-1)  # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement int32


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: → int8 with `size` elements along `dim`."""
    if dim == 0:
        return unpack_int32(packed.t(), num_bits, size).t().contiguous()
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    u = (packed.to(torch.int64)[..., None] >> shifts) & ((1 << num_bits) - 1)  # (R, words, per_word)
    return (u.reshape(packed.shape[0], -1)[:, :size] - (1 << (num_bits - 1))).to(torch.int8)


# ------------------------------------------------------------------------------ save
def quantized_modules(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """HF name → (our path, module) of every QuantLinear / QuantExperts outside QuantExperts."""
    names = {path: hf for hf, path in module_names(model).items()}
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantExperts)) and ".gate_up." not in path and ".down." not in path:
            found[names[path]] = (path, module)
    return found


def linear_tensors(name: str, module: QuantLinear, rows: slice | None = None) -> dict[str, torch.Tensor]:
    """The compressed-tensors entries of one linear (`rows`: a slice of its output rows)."""
    rows = rows or slice(None)
    scheme, w = module.scheme, module.scheme.weights
    q, scale = module.qweight[rows], module.weight_scale[rows].float()
    out = {f"{name}.weight_scale": scale.contiguous()}
    if scheme.format == "int-quantized":
        out[f"{name}.weight"] = q.contiguous()
        if module.input_scale is not None:
            out[f"{name}.input_scale"] = module.input_scale.float().clone()
    else:
        out[f"{name}.weight_packed"] = pack_int32(q, w.num_bits)
        out[f"{name}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
        if not w.symmetric:
            out[f"{name}.weight_zero_point"] = pack_int32(module.weight_zero_point[rows], w.num_bits, dim=0)
    if module.bias is not None:
        out[f"{name}.bias"] = module.bias.clone()
    return out


def quantization_config(model: nn.Module, schemes: dict[str, Scheme]) -> dict:
    """`schemes`: HF name → scheme of every quantized linear. The main scheme targets "Linear";
    kv_b_proj's weight-only variant under W8A8 gets a group of its own (a regex beats a class name)."""
    by_name: dict[str, list[str]] = {}
    for name, scheme in schemes.items():
        by_name.setdefault(scheme.name, []).append(name)
    groups, formats = {}, set()
    main = max(by_name, key=lambda s: len(by_name[s])) if by_name else None
    for i, (scheme_name, names) in enumerate(sorted(by_name.items(), key=lambda kv: kv[0] != main)):
        scheme = schemes[names[0]]
        if scheme_name == main:
            targets = ["Linear"]
        elif all(n.endswith("self_attn.kv_b_proj") for n in names):
            targets = [KV_B_TARGET]
        else:
            targets = sorted(names)
        act = scheme.input_activations
        groups[f"group_{i}"] = {"targets": targets, "weights": scheme.weights.to_config(),
                                "input_activations": act.to_config() if act else None,
                                "output_activations": None, "format": scheme.format}
        formats.add(scheme.format)
    ignore = sorted(n for n in quantizable(model) if n not in schemes)
    return {"quant_method": "compressed-tensors", "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
            "kv_cache_scheme": None, "global_compression_ratio": None}


def save_compressed(model: nn.Module, path: str | Path, tokenizer_dir: str | Path | None = None) -> None:
    """Write a quantized model (QuantLinear / QuantExperts swapped in) as a compressed-tensors checkpoint."""
    path = Path(path)
    quantized = quantized_modules(model)
    params = model.state_dict(keep_vars=True)
    owned = tuple(p + "." for p, _ in quantized.values())
    dtype = model.embed_tokens.weight.dtype
    tensors, schemes = {}, {}
    for name, slot in hf_layout(model).items():
        if slot.target.startswith(owned) or slot.copy_of_shared and "lm_head" in quantized:
            continue
        keep_fp32 = slot.target.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        source = params[slot.target].detach()[slot.index]
        tensors[name] = source.to("cpu", torch.float32 if keep_fp32 else dtype, copy=True).contiguous()
    for hf, (_, module) in quantized.items():
        if isinstance(module, QuantLinear):
            tensors.update(linear_tensors(hf, module))
            schemes[hf] = module.scheme
            continue
        for e, (gate_up, down) in enumerate(zip(module.gate_up, module.down, strict=True)):
            inter = gate_up.out_features // 2
            tensors.update(linear_tensors(f"{hf}.{e}.gate_proj", gate_up, slice(0, inter)))
            tensors.update(linear_tensors(f"{hf}.{e}.up_proj", gate_up, slice(inter, 2 * inter)))
            tensors.update(linear_tensors(f"{hf}.{e}.down_proj", down))
            schemes.update({f"{hf}.{e}.{p}": gate_up.scheme for p in ("gate_proj", "up_proj", "down_proj")})
    config = hf_config(model, dtype, fp8=False)
    config["quantization_config"] = quantization_config(model, schemes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if tokenizer_dir is not None and (Path(tokenizer_dir) / file).exists():
                shutil.copy2(Path(tokenizer_dir) / file, tmp / file)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------ load
def is_compressed(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    qc = json.loads(config.read_text()).get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors"


def scheme_from_config(group: dict, name: str) -> Scheme:
    def args(d: dict | None, what: str) -> QuantArgs | None:
        if d is None:
            return None
        if d.get("type", "int") != "int" or d.get("num_bits") not in (4, 8) or d.get("actorder") == "group":
            raise ValueError(f"quantization_config group {name}: {what} {d} is not supported (int4/int8, "
                             "channel/group/token/tensor strategies, no group act-order)")
        return QuantArgs(d["num_bits"], d["strategy"], d.get("symmetric", True), d.get("group_size"),
                         bool(d.get("dynamic", False)))

    weights, act = args(group.get("weights"), "weights"), args(group.get("input_activations"), "input_activations")
    if weights is None or (act is not None and (weights.num_bits != 8 or act.num_bits != 8)):
        raise ValueError(f"quantization_config group {name}: only W8A8, W8A16 and W4A16 are supported")
    label = (f"w{weights.num_bits}a{act.num_bits}-{'dynamic' if act.dynamic else 'static'}" if act
             else f"w{weights.num_bits}a16" + ("" if weights.symmetric else "-asym"))
    return Scheme(label, weights, act)


def module_schemes(model: nn.Module, qc: dict) -> dict[str, Scheme]:
    """HF name → scheme for each quantizable module, with compressed-tensors' precedence."""
    targets: dict[str, Scheme] = {}
    for group_name, group in qc["config_groups"].items():
        scheme = scheme_from_config(group, group_name)
        for t in group["targets"]:
            targets.setdefault(t, scheme)
    ordered = sorted(targets, key=lambda t: (t == "Linear", t.startswith("re:")))  # exact, regex, class
    plan = {}
    for name in quantizable(model):
        if any(matches(p, name) for p in qc.get("ignore") or [] if p != "Linear"):
            continue
        hit = next((t for t in ordered if matches(t, name)), None)
        if hit is not None:
            plan[name] = targets[hit]
    return plan


def load_compressed(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """A compressed-tensors checkpoint → our Transformer with QuantLinear / QuantExperts in place."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"{path}: quantization_status {qc.get('quantization_status')!r}; only compressed "
                         "checkpoints (as llm-compressor saves them) are supported")
    cfg = ModelConfig.from_hf(path)
    files, _ = shard_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with open_shard(file) as f:  # a truncated or corrupt file: a ValueError naming it
            for name in f.keys():
                tensors[name] = read_tensor(f, name, file)
    cfg = drop_absent_mtp(cfg, dict.fromkeys(tensors, files[0]))
    model = materialize(cfg, device, dtype)
    plan = module_schemes(model, qc)
    every = module_names(model)
    layout = hf_layout(model)
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, slot in layout.items():
            base = name.removesuffix(".weight")
            if base in plan or slot.copy_of_shared or _expert_parent(base) in plan_experts(plan):
                continue
            if name not in tensors:
                raise ValueError(f"{path} lacks tensor {name!r}, which its config.json needs")
            params[slot.target][slot.index].copy_(tensors[name])
        for hf, scheme in plan.items():
            if _expert_parent(hf) is None:
                parent, _, attr = every[hf].rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr,
                        read_linear(tensors, hf, scheme, dtype).to(device))
        for experts_hf in plan_experts(plan):
            experts: GroupedExperts = model.get_submodule(every[experts_hf])
            num = experts.down_proj.shape[0]
            scheme = plan[f"{experts_hf}.0.gate_proj"]
            gate_up = [merge_rows(read_linear(tensors, f"{experts_hf}.{e}.gate_proj", scheme, dtype),
                                  read_linear(tensors, f"{experts_hf}.{e}.up_proj", scheme, dtype)) for e in range(num)]
            down = [read_linear(tensors, f"{experts_hf}.{e}.down_proj", scheme, dtype) for e in range(num)]
            parent, _, attr = every[experts_hf].rpartition(".")
            setattr(model.get_submodule(parent), attr, QuantExperts(gate_up, down).to(device))
    return model.eval()


def _expert_parent(hf: str) -> str | None:
    head, sep, tail = hf.rpartition(".experts.")
    return f"{head}.experts" if sep and tail.split(".")[0].isdigit() else None


def plan_experts(plan: dict[str, Scheme]) -> set[str]:
    return {p for p in map(_expert_parent, plan) if p is not None}


def read_linear(tensors: dict[str, torch.Tensor], name: str, scheme: Scheme,
                dtype: torch.dtype = torch.float32) -> QuantLinear:
    w = scheme.weights
    if f"{name}.weight_packed" in tensors:
        out_features, in_features = tensors[f"{name}.weight_shape"].tolist()
        q = unpack_int32(tensors[f"{name}.weight_packed"], w.num_bits, in_features)
    elif f"{name}.weight" in tensors and tensors[f"{name}.weight"].dtype == torch.int8:
        q = tensors[f"{name}.weight"]
    else:
        raise ValueError(f"compressed-tensors checkpoint lacks the quantized weight of {name!r} "
                         "(weight_packed or int8 weight)")
    scale = tensors[f"{name}.weight_scale"].float()
    zero_point = None
    if not w.symmetric:
        groups = scale.shape[-1]
        zero_point = unpack_int32(tensors[f"{name}.weight_zero_point"], w.num_bits, q.shape[0], dim=0)
        zero_point = zero_point.reshape(q.shape[0], groups)
    input_scale = tensors.get(f"{name}.input_scale")
    return QuantLinear.from_quantized(scheme, q, scale, zero_point, input_scale, tensors.get(f"{name}.bias"), dtype)


def merge_rows(gate: QuantLinear, up: QuantLinear) -> QuantLinear:
    """gate (I, H) and up (I, H) → one (2I, H) QuantLinear, gate rows first. The two see the same input:
    a static input scale is their max (llm-compressor calibrates them on identical inputs)."""
    input_scale = None
    if gate.input_scale is not None:
        input_scale = torch.maximum(gate.input_scale, up.input_scale)
    zp = None if gate.weight_zero_point is None else torch.cat([gate.weight_zero_point, up.weight_zero_point])
    scale = torch.cat([gate.weight_scale, up.weight_scale])
    return QuantLinear.from_quantized(gate.scheme, torch.cat([gate.qweight, up.qweight]), scale, zp, input_scale,
                                      dtype=gate.dtype)
