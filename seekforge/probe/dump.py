"""Module-level dumps: forward/backward hooks on the modules a DumpConfig selects, recording every
call's inputs and outputs (forward) and gradients (backward) as statistics, hashes or tensors.

Works on any `nn.Module`. A record is one call of one module in one direction:
    {"order": 12, "module": "layers.1.self_attn", "class": "MLA", "call": 0, "direction": "forward",
     "tensors": {"input.0": {"dtype", "shape", "max", "min", "mean", "norm", "nan", "inf"[, "md5"]},
                 "output.0": {...}}}
`order` is the execution order (a forward record is taken when its call returns, so children come
before their parent; backward records when the module's input gradients are ready). `call` numbers
repeated calls of one module (a shared head called for the main and the MTP losses). Slots are
input.i / input.NAME (keyword arguments) / output.i, and grad_input.i / grad_output.i in backward;
nested tuples and dicts get dotted suffixes (`output.0.1`).

On disk, per step and rank: DIR/step{S}/rank{R}/records.jsonl, modules.json (every module's class,
the hierarchy the report draws) and, in tensor mode, tensors.safetensors keyed
"{direction}/{module}/{call}/{slot}".
"""

from __future__ import annotations

import hashlib
import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from seekforge.model.hf import save_safetensors
from seekforge.probe.config import DumpConfig, module_matcher

STAT_NAMES = ("max", "min", "mean", "norm", "nan", "inf")
# A module whose inputs need no gradient (the embedding) still gets its output gradients recorded;
# torch warns about exactly that on every call.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to "
                        "module outputs")


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def flatten_tensors(value, prefix: str):
    """(key, tensor) for every tensor inside nested tuples/lists/dicts (a `ModelOutput` is a dict)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from flatten_tensors(item, f"{prefix}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from flatten_tensors(item, f"{prefix}.{key}")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (each rank dumps what it holds)."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_summary(t: torch.Tensor, with_md5: bool = False) -> dict:
    """dtype, shape and the STAT_NAMES values, the latter still a device tensor under "values" so that
    recording a call never waits for the device; `materialize` turns them into numbers."""
    t = local(t).detach()
    summary = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if t.numel() == 0:
        summary["values"] = None
    else:
        # Everything but fp64 reduces in fp32; one upcast copy first is faster on CPU than reductions
        # that upcast element by element (bf16 mean and norm with dtype=float32).
        x = t if t.dtype in (torch.float32, torch.float64) else t.float()
        acc = x.dtype
        low, high = torch.aminmax(x)
        norm = torch.linalg.vector_norm(x, dtype=acc)
        if x.device.type == "cpu" and torch.isfinite(norm):
            # A finite norm means no NaN or Inf; on CPU checking costs no device wait, and counting
            # (a bool tensor and its sum) would cost more than all the other statistics together.
            nan = inf = torch.zeros((), dtype=acc)
        else:
            nan, inf = torch.count_nonzero(x.isnan()), torch.count_nonzero(x.isinf())
        summary["values"] = torch.stack([high.to(acc), low.to(acc), x.mean(dtype=acc), norm, nan.to(acc),
                                         inf.to(acc)])
    if with_md5:
        summary["md5"] = hashlib.md5(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return summary


def materialize(summary: dict) -> dict:
    values = summary.pop("values")
    numbers = values.tolist() if values is not None else [None] * len(STAT_NAMES)
    for name, number in zip(STAT_NAMES, numbers, strict=True):
        summary[name] = int(number) if name in ("nan", "inf") and number is not None else number
    return summary


class Dumper:
    """Hooks on the selected modules of `model`, armed only during a selected step:

        dumper = Dumper(model, DumpConfig(mode="tensor", modules=["layers.*"]))
        with dumper.step(0):          # writes DIR/step0/rank0/ on exit
            model(ids).sum().backward()
    """

    def __init__(self, model: nn.Module, cfg: DumpConfig, rank: int | None = None):
        self.model, self.cfg = model, cfg
        self.rank = current_rank() if rank is None else rank
        wanted = module_matcher(cfg.modules)
        self.targets = [(name, module) for name, module in model.named_modules() if name and wanted(name)]
        self.handles: list = []
        self.records: list[dict] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self._calls: dict[tuple[str, str], int] = {}
        self._pending: dict[str, list[dict]] = {}  # module → its open forward calls (recursion-safe)

    def selected(self, step: int) -> bool:
        return (not self.cfg.steps or step in self.cfg.steps) and (not self.cfg.ranks or self.rank in self.cfg.ranks)

    # ------------------------------------------------------------------ arming
    def start(self, step: int) -> bool:
        """Register the hooks when `step` is selected; True when they are armed."""
        assert not self.handles, "start() twice without stop()"
        if not self.selected(step):
            return False
        self.records, self.tensors, self._calls, self._pending = [], {}, {}, {}
        for name, module in self.targets:
            if "forward" in self.cfg.directions:
                self.handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True))
            if "backward" in self.cfg.directions:
                self.handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        return True

    def stop(self) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """Remove the hooks; return the records (statistics as numbers) and the tensors kept."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for record in self.records:
            for summary in record["tensors"].values():
                if "values" in summary:
                    materialize(summary)
        return self.records, self.tensors

    @contextmanager
    def step(self, step: int, out_dir: str | Path | None = None):
        """Arm for `step`, run the body, write the dump (nothing when the step is not selected)."""
        if not self.start(step):
            yield None
            return
        try:
            yield self
        finally:
            records, tensors = self.stop()
            write_dump(out_dir or self.cfg.out_dir, step, self.rank, records, tensors, module_classes(self.model))

    # ------------------------------------------------------------------ hooks
    def _new_record(self, name: str, module: nn.Module, direction: str) -> dict:
        call = self._calls.get((name, direction), 0)
        self._calls[(name, direction)] = call + 1
        return {"order": -1, "module": name, "class": type(module).__name__, "call": call,
                "direction": direction, "tensors": {}}

    def _add(self, record: dict, slot_kind: str, prefix: str, value) -> None:
        if slot_kind not in self.cfg.slots:
            return
        for slot, t in flatten_tensors(value, prefix):
            record["tensors"][slot] = tensor_summary(t, with_md5=self.cfg.mode == "md5")
            if self.cfg.mode == "tensor":
                key = f"{record['direction']}/{record['module']}/{record['call']}/{slot}"
                self.tensors[key] = local(t).detach().to("cpu", copy=True).contiguous()

    def _finish(self, record: dict) -> None:
        record["order"] = len(self.records)
        self.records.append(record)

    def _pre_hook(self, name: str):
        def hook(module, args, kwargs):
            if _replaying():
                return
            record = self._new_record(name, module, "forward")
            # Inputs are read at call time: the caller may change them in place afterwards.
            self._add(record, "input", "input", args)
            self._add(record, "input", "input", kwargs)
            self._pending.setdefault(name, []).append(record)
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            if _replaying():
                return
            record = self._pending[name].pop()
            # A bare tensor is slot output.0, as the first element of a tuple would be: implementations
            # that return (out, attn_weights) and ones that return out then line up.
            self._add(record, "output", "output", (output,) if isinstance(output, torch.Tensor) else output)
            self._finish(record)
        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            record = self._new_record(name, module, "backward")
            self._add(record, "output", "grad_output", grad_output)
            self._add(record, "input", "grad_input", grad_input)
            self._finish(record)
        return hook


def _replaying() -> bool:
    """A forward run inside backward is activation recompute replaying a call already recorded."""
    return torch._C._current_graph_task_id() != -1


def module_classes(model: nn.Module) -> dict[str, str]:
    return {name: type(module).__name__ for name, module in model.named_modules() if name}


def dump_dir(root: str | Path, step: int, rank: int) -> Path:
    return Path(root) / f"step{step}" / f"rank{rank}"


def write_dump(root: str | Path, step: int, rank: int, records: list[dict], tensors: dict[str, torch.Tensor],
               classes: dict[str, str]) -> Path:
    """Write one step's dump of one rank; returns its directory."""
    path = dump_dir(root, step, rank)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "records.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    (path / "modules.json").write_text(json.dumps(classes, indent=0))
    if tensors:
        save_safetensors(tensors, path / "tensors.safetensors")
    return path
