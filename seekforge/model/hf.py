"""Hugging Face DeepSeek-V3 checkpoints ⇄ seekforge: names, sharded safetensors, FP8 block scales.

An HF checkpoint is a directory with `config.json` and one or many `*.safetensors` shards (with
`model.safetensors.index.json` when there are several). Its tensor names differ from ours in three
ways, all handled by `hf_layout`:
  * a `model.` prefix on everything but `lm_head.weight`;
  * routed experts are stored one per tensor (`mlp.experts.E.{gate,up,down}_proj.weight`, as the
    official checkpoints and transformers 5 save them) while we stack them (`experts.gate_up_proj`
    (E, 2I, H) with gate rows first, `experts.down_proj` (E, H, I));
  * MTP module k is stored as decoder layer `num_hidden_layers + k`: its block weights sit directly
    under that layer, `shared_head.norm` is our `mtp.k.norm`, and `embed_tokens` /
    `shared_head.head` are copies of the main model's (written on save, skipped on load).

Official FP8 checkpoints store linear weights as float8_e4m3fn with a companion `<name>_scale_inv`
(fp32, one scale per 128×128 block): w = fp8 · scale_inv. The routing gate stays fp32 in every format.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from seekforge.config import ModelConfig, parse_bytes
from seekforge.errors import UserError
from seekforge.model.model import Transformer, build_model

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_BLOCK = 128
INDEX_FILE = "model.safetensors.index.json"
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


# ------------------------------------------------------------------------------- FP8 blocks
def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) → w_fp8 (out, in) float8_e4m3fn, scale_inv (⌈out/block⌉, ⌈in/block⌉) fp32.

    Each block is scaled so its largest |value| maps to e4m3's max (448); edge blocks are padded with
    zeros, which never raise a block's max. Dequantize with w ≈ w_fp8 · scale_inv (block-expanded).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block takes a 2-D weight (out, in), got shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    rows, cols = math.ceil(out_dim / block), math.ceil(in_dim / block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    blocks = padded.view(rows, block, cols, block)  # (rows, block, cols, block)
    amax = blocks.abs().amax(dim=(1, 3))  # (rows, cols)
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # all-zero block: any scale
    scaled = blocks / scale_inv[:, None, :, None]
    # amax / (amax / 448) can round a hair above 448, which e4m3 would turn into NaN.
    w_fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows * block, cols * block)
    return w_fp8[:out_dim, :in_dim].contiguous(), scale_inv


def dequantize_fp8_block(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """w_fp8 (out, in), scale_inv (⌈out/block⌉, ⌈in/block⌉) → fp32 (out, in)."""
    out_dim, in_dim = w_fp8.shape
    expected = (math.ceil(out_dim / block), math.ceil(in_dim / block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for a weight of "
                         f"shape {(out_dim, in_dim)} in {block}×{block} blocks; the checkpoint's scales do not "
                         "match its weights (check quantization_config.weight_block_size)")
    scale = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_dim, :in_dim]
    return w_fp8.float() * scale


# ------------------------------------------------------------------------------- names
@dataclass(frozen=True)
class Slot:
    """Where one HF tensor lives in seekforge: `state_dict[target][index]`."""

    target: str  # seekforge state-dict key
    index: tuple = ()  # e.g. (expert, slice(0, I)) for a gate_proj inside the stacked gate_up_proj
    copy_of_shared: bool = False  # an MTP layer's copy of embed_tokens / lm_head: saved, never loaded


def hf_layout(model: Transformer) -> dict[str, Slot]:
    """Every tensor of the official HF layout (per-expert names, MTP as extra layers), in save order."""
    cfg = model.cfg
    layout: dict[str, Slot] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # one tensor, saved as embed_tokens (HF does the same)
        hf = hf_name(name, cfg)
        if hf.endswith(".mlp.experts.gate_up_proj"):  # (E, 2I, H): gate rows, then up rows
            experts, inter = hf.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                layout[f"{experts}.{e}.gate_proj.weight"] = Slot(name, (e, slice(0, inter)))
                layout[f"{experts}.{e}.up_proj.weight"] = Slot(name, (e, slice(inter, 2 * inter)))
        elif hf.endswith(".mlp.experts.down_proj"):  # (E, H, I)
            experts = hf.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                layout[f"{experts}.{e}.down_proj.weight"] = Slot(name, (e,))
        else:
            layout[hf] = Slot(name)
    for k in range(len(model.mtp)):
        layer = f"model.layers.{cfg.num_hidden_layers + k}"
        layout[f"{layer}.embed_tokens.weight"] = Slot("embed_tokens.weight", copy_of_shared=True)
        layout[f"{layer}.shared_head.head.weight"] = Slot("lm_head.weight", copy_of_shared=True)
    return layout


def hf_name(name: str, cfg: ModelConfig) -> str:
    """seekforge state-dict key → HF key (stacked experts keep their stacked name here)."""
    if name == "lm_head.weight":
        return name
    mtp = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if mtp is None:
        return f"model.{name}"
    layer = f"model.layers.{cfg.num_hidden_layers + int(mtp[1])}"
    rest = mtp[2]
    if rest.startswith("block."):
        return f"{layer}.{rest[len('block.'):]}"
    if rest == "norm.weight":
        return f"{layer}.shared_head.norm.weight"
    return f"{layer}.{rest}"  # enorm, hnorm, eh_proj


def packed_expert_names(layout: dict[str, Slot]) -> dict[str, tuple[Slot, list[str]]]:
    """transformers' internal stacked names (`mlp.experts.gate_up_proj`) → (whole-tensor slot, the
    per-expert names it covers), so either form loads."""
    packed: dict[str, tuple[Slot, list[str]]] = {}
    for name, slot in layout.items():
        m = re.fullmatch(r"(.+\.mlp\.experts)\.\d+\.(gate|up|down)_proj\.weight", name)
        if m is None:
            continue
        key = f"{m[1]}.{'down_proj' if m[2] == 'down' else 'gate_up_proj'}"
        packed.setdefault(key, (Slot(slot.target), []))[1].append(name)
    return packed


def is_fp8_linear(hf: str) -> bool:
    """Linear weights the official checkpoint stores in FP8: attention and MLP / expert projections.
    Not norms, embeddings, lm_head, the router gate, or the MTP eh_proj (bf16 in the official files)."""
    return re.search(r"\.(self_attn|mlp)\..*_proj(_with_mqa)?\.weight$", hf) is not None


# ------------------------------------------------------------------------------- load
def refuse_compressed(path: Path) -> None:
    """A compressed-tensors checkpoint (`seekforge quantize`, llm-compressor) holds integer weights and scales that
    only the quantized loaders read (serve, eval): say so, rather than name a tensor with "no place" in the model."""
    try:
        quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return  # from_hf has read it already; anything odd is its to report
    if quant.get("quant_method") == "compressed-tensors":
        raise UserError(f"{path} is a quantized (compressed-tensors) checkpoint, which this command does not load: "
                        f"serve it (seekforge serve --model {path}) or evaluate it (seekforge eval --model {path}); "
                        "for this command, use the checkpoint it was quantized from")


def load_hf(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """Load an HF DeepSeek-V3 checkpoint directory (bf16, fp32 or official FP8) into a Transformer.

    The model is built on the meta device and materialized once; tensors then stream in one at a
    time, shard by shard, so the weights are never held twice. FP8 weights are dequantized on load.
    Returned in eval mode, like `from_pretrained`.
    """
    path = Path(path)
    cfg = ModelConfig.from_hf(path)
    refuse_compressed(path)
    files, indexed = shard_files(path)
    where = tensor_files(files)
    cfg = drop_absent_mtp(cfg, where)
    model = materialize(cfg, device, dtype)
    layout = hf_layout(model)
    packed = packed_expert_names(layout)
    params = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with open_shard(file) as f:
                for name in f.keys():
                    if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in where:
                        continue  # read with its weight
                    slot, covers = (layout[name], [name]) if name in layout else packed.get(name, (None, None))
                    if slot is None:
                        raise ValueError(f"unexpected tensor {name!r} in {file}: it has no place in a model with "
                                         f"this config.json; fix config.json (layer, expert or MTP counts) or "
                                         f"remove the tensor")
                    if slot.copy_of_shared:
                        continue  # the MTP layer's copy of embed_tokens / lm_head
                    tensor = read_tensor(f, name, file)
                    dest = params[slot.target][slot.index]
                    if tensor.dtype == FP8_DTYPE:  # dequantize where the weight goes (a GPU does it fastest)
                        scale_inv = read_scale_inv(name, file, where).to(dest.device)
                        tensor = dequantize_fp8_block(tensor.to(dest.device), scale_inv)
                    if tensor.shape != dest.shape:
                        raise ValueError(f"tensor {name!r} in {file} has shape {tuple(tensor.shape)}, but this "
                                         f"config.json needs {tuple(dest.shape)}; the weights and config.json "
                                         f"disagree: fix config.json or re-export the checkpoint")
                    dest.copy_(tensor)
                    loaded.update(covers)
    missing = [n for n, s in layout.items() if n not in loaded and not s.copy_of_shared]
    if missing:
        shown = [f"{n!r}" + (f" (the index puts it in {indexed[n]})" if n in indexed else "") for n in missing[:5]]
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s) its config.json needs: "
                         f"{', '.join(shown)}{more}; re-download or re-save the shard(s), or fix config.json")
    return model


def shard_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The shards the index names (in order) and its weight map, or every *.safetensors file and {}
    when there is no index."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e!r}); re-download it or delete it "
                             "to load every *.safetensors file in the directory") from e
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise ValueError(f"{index} names shard(s) that do not exist: {absent}; download them")
        return files, weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}; pass a checkpoint directory")
    return files, {}


def open_shard(file: Path):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for bad headers and short files
        raise ValueError(f"{file} is not a readable safetensors file ({e}); it is truncated or corrupt: "
                         "re-download or re-save it") from e


def read_tensor(f, name: str, file: Path) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"cannot read tensor {name!r} from {file} ({e}); the file is corrupt: "
                         "re-download or re-save it") from e


def tensor_files(files: list[Path]) -> dict[str, Path]:
    """Tensor name → the shard holding it (headers only; also catches corrupt files before any work)."""
    where: dict[str, Path] = {}
    for file in files:
        with open_shard(file) as f:
            for name in f.keys():
                if name in where:
                    raise ValueError(f"tensor {name!r} is in both {where[name]} and {file}; remove the stale shard")
                where[name] = file
    return where


def read_scale_inv(name: str, file: Path, where: dict[str, Path]) -> torch.Tensor:
    scale_name = f"{name}_scale_inv"
    if scale_name not in where:
        raise ValueError(f"FP8 tensor {name!r} in {file} has no {scale_name!r} in the checkpoint; an official "
                         "FP8 checkpoint stores one per weight: re-download the shard that holds it")
    with open_shard(where[scale_name]) as f:
        return read_tensor(f, scale_name, where[scale_name])


def drop_absent_mtp(cfg: ModelConfig, where: dict[str, Path]) -> ModelConfig:
    """transformers does not keep MTP layers when it saves; load such a checkpoint without them."""
    present = 0
    while present < cfg.num_nextn_predict_layers and any(
        n.startswith(f"model.layers.{cfg.num_hidden_layers + present}.") for n in where
    ):
        present += 1
    if present < cfg.num_nextn_predict_layers:
        warnings.warn(f"config.json has num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the "
                      f"checkpoint holds weights for {present} MTP layer(s) (transformers drops them on save); "
                      f"loading with num_nextn_predict_layers={present}", stacklevel=3)
        cfg = cfg.replace(num_nextn_predict_layers=present)
    return cfg


def materialize(cfg: ModelConfig, device, dtype: torch.dtype) -> Transformer:
    """Uninitialized storage for every weight, in `dtype` (routing gate fp32), on `device`."""
    model = build_model(cfg, device="meta").cast(dtype)
    model.to_empty(device=device)
    return model.init_buffers().eval()  # non-persistent buffers are not in the checkpoint


# ------------------------------------------------------------------------------- save
@dataclass
class Entry:
    """One weight to write (with its `_scale_inv` when FP8), sized before any tensor is made."""

    name: str  # HF name
    slot: Slot
    dtype: torch.dtype  # written dtype when not FP8
    fp8: bool
    nbytes: int  # in the file, scale included


def save_hf(model: Transformer, path: str | Path, max_shard_size: int | str = "5GB",
            dtype: torch.dtype | None = None, fp8: bool = False) -> None:
    """Write `model` as an HF DeepSeek-V3 checkpoint that `load_hf` and transformers both read.

    dtype: of the written weights (default: as in the model); the routing gate stays fp32.
    fp8: linear weights as float8_e4m3fn + `weight_scale_inv` in 128×128 blocks, like the official
    checkpoint. Shards are produced one at a time; everything is written to a temporary directory
    next to `path` and renamed into place, so `path` never holds a half-written checkpoint. Other
    files already in `path` (tokenizer, generation config) are kept.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; save_hf writes a checkpoint directory: pass a directory path")
    limit = parse_bytes(max_shard_size, "max_shard_size")
    entries = save_entries(model, dtype, fp8)
    shards = pack_shards(entries, limit)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        params = model.state_dict(keep_vars=True)
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for entry in shard:
                tensors.update(produce(entry, params))
            save_safetensors(tensors, tmp / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            del tensors
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config(model, dtype, fp8)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # transformers' generate() stops at generation_config's eos_token_id, not config.json's.
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_entries(model: Transformer, dtype: torch.dtype | None, fp8: bool) -> list[Entry]:
    params = model.state_dict(keep_vars=True)
    entries = []
    for name, slot in hf_layout(model).items():
        shape = params[slot.target][slot.index].shape
        keep_fp32 = slot.target.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        out_dtype = torch.float32 if keep_fp32 else (dtype or params[slot.target].dtype)
        quantize = fp8 and is_fp8_linear(name)
        if quantize:  # 1 byte per weight + an fp32 scale per block
            nbytes = shape.numel() + 4 * math.ceil(shape[0] / FP8_BLOCK) * math.ceil(shape[1] / FP8_BLOCK)
        else:
            nbytes = shape.numel() * out_dtype.itemsize
        entries.append(Entry(name, slot, out_dtype, quantize, nbytes))
    return entries


def produce(entry: Entry, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensor(s) of one entry, as fresh CPU copies (expert slices must not share storage)."""
    source = params[entry.slot.target].detach()[entry.slot.index]
    if entry.fp8:
        w_fp8, scale_inv = quantize_fp8_block(source)
        return {entry.name: w_fp8.cpu(), f"{entry.name}_scale_inv": scale_inv.cpu()}
    return {entry.name: source.to("cpu", entry.dtype, copy=True).contiguous()}


def pack_shards(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Greedy, in order; a weight larger than the limit gets a shard of its own (as HF does)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def hf_config(model: Transformer, dtype: torch.dtype | None, fp8: bool) -> dict:
    config = model.cfg.to_hf()
    # A loaded checkpoint's config carries these in `extra`; they describe the old files, not these
    # (auto_map points at remote-code .py files we do not write; transformers has deepseek_v3 built in).
    for stale in ("quantization_config", "torch_dtype", "dtype", "auto_map"):
        config.pop(stale, None)
    # MLA has no key/value head groups, but transformers repeats keys num_attention_heads //
    # num_key_value_heads times: equal counts (DeepSeek-V3's 128/128), not the dataclass default 128.
    config["num_key_value_heads"] = model.cfg.num_attention_heads
    dtype_name = str(dtype or model.embed_tokens.weight.dtype).removeprefix("torch.")
    config["torch_dtype"] = config["dtype"] = dtype_name  # transformers 4 reads the first, 5 the second
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    return config


def save_safetensors(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, leaving the file with the permissions any new file gets (0644 under umask 022):
    save_file itself leaves 0600, which a server under another account, or a copy shared with others, cannot read."""
    save_file(tensors, file, metadata=metadata)
    umask = os.umask(0)  # the only portable way to read it
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


def replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished checkpoint `tmp` to `path`, keeping files of `path` that are not weights."""
    if not path.exists():
        os.replace(tmp, path)
        return
    for item in path.iterdir():
        if item.suffix == ".safetensors" or item.name in (INDEX_FILE, "config.json", "generation_config.json"):
            continue
        if item.is_dir():
            shutil.copytree(item, tmp / item.name)
        else:
            shutil.copy2(item, tmp / item.name)
    # Directories cannot be renamed over a non-empty one: move the old aside, then drop it. A crash
    # in between leaves the old checkpoint intact at the aside name, never a mix.
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old)
