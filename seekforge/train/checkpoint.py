"""Training checkpoints with torch.distributed.checkpoint (DCP): save, exact resume, atomic swap,
for a plain model and a parallelized one alike (FSDP/HSDP, TP, EP DTensors, pipeline stages).

Layout under `<out_dir>/checkpoints/`:
    step_000100/        DCP files: model, optimizer, scheduler, step, data-loader position
    step_000100/config.json  the ModelConfig (HF keys), so a checkpoint rebuilds its own model
    step_000100/rank0.pt  rank-local RNG states (torch CPU/CUDA, python, numpy)
    step_000100/layout.json  the saving layout: every weight's placement (parallel/layout.Layout)
    latest              text file naming the newest complete checkpoint, written last

Any layout → any layout: `get_state_dict` names every weight and optimizer state by its full-model
name ("layers.3.mlp...", "state.layers.3.mlp....exp_avg", flattened so pipeline stages merge by
plain dict union) and keeps sharded tensors as DTensors with their global shapes; DCP writes each
shard once and reshards on load. So a run saved on 4 ranks (FSDP × TP × EP) resumes on a 2-rank
pipeline or on one process, and `seekforge convert` reads it without a process group. The loader
position is the global batch counter (data/dataset.BatchLoader), the same on every rank, so it is
stored once in the DCP state; RNG states are per rank and restored only where the rank existed.

Atomicity: everything is written into `step_000100.tmp/` and renamed only when complete; `latest`
is replaced with os.replace after that. A crash at any point leaves `latest` naming a complete
checkpoint (a stale `.tmp` directory is ignored and cleaned up by the next save).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from seekforge.parallel.layout import layout_of_model

# Flat optimizer keys ("state.<fqn>.exp_avg") merge across pipeline stages by plain dict union.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step_(\d+)$")


@contextmanager
def _quiet_dcp():
    """DCP warns on every call that it runs without a process group; on one device that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_list(x) -> list:
    return list(x) if isinstance(x, list | tuple) else [x]


def _state(modules: list[nn.Module], optimizers: list | None) -> dict:
    """{"model": ..., "optim": ...} merged over this rank's modules. Pipeline stages share no name
    except the last stage's copy of the embedding (MTP), which holds the same values as the first's."""
    state = {"model": {}}
    if optimizers is None:
        for module in modules:
            state["model"].update(get_model_state_dict(module))
        return state
    state["optim"] = {}
    for module, optimizer in zip(modules, optimizers, strict=True):
        m, o = get_state_dict(module, optimizer, options=_OPTIONS)
        state["model"].update(m)
        state["optim"].update(o)
    return state


def save_checkpoint(ckpt_root: str | Path, step: int, model, optimizer=None, scheduler=None, loader=None,
                    keep: int = 2) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep`. Every rank
    calls it. model / optimizer: a module and its optimizer, or parallel lists of this rank's
    pipeline stages and their optimizers. optimizer=None writes a weights-only checkpoint (what
    `seekforge convert` makes from HF)."""
    modules = _as_list(model)
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    if _rank() == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = _state(modules, None if optimizer is None else _as_list(optimizer))
    state["trainer"] = {"step": step}
    if scheduler is not None:
        state["trainer"]["scheduler"] = scheduler.state_dict()
    if loader is not None:
        state["trainer"]["loader"] = loader.state_dict()
    with _quiet_dcp():
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save({"rng": rng_state()}, tmp / f"rank{_rank()}.pt")
    layout = layout_of_model(modules)  # collective: every rank's placements
    if _rank() == 0:  # where each weight lived when saved (parallel/layout.py); DCP itself needs no layout
        layout.save(tmp / "layout.json")
    if _rank() == 0 and hasattr(modules[0], "cfg"):  # self-describing: convert and resume rebuild from it
        (tmp / "config.json").write_text(json.dumps(modules[0].cfg.to_hf(), indent=2))
    _barrier()
    if _rank() == 0:
        if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(ckpt_root, final.name)
        _prune(ckpt_root, step, keep)
    _barrier()
    return final


def _write_latest(ckpt_root: Path, name: str) -> None:
    pointer_tmp = ckpt_root / "latest.tmp"
    pointer_tmp.write_text(name + "\n")
    os.replace(pointer_tmp, ckpt_root / "latest")


def _prune(ckpt_root: Path, latest_step: int, keep: int) -> None:
    """Keep the `keep` newest checkpoints up to `latest_step`; later steps can only be leftovers of
    an older run in the same directory, and go too."""
    steps = sorted((int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := _STEP_DIR.match(p.name)))
    older = [path for step, path in steps if step < latest_step]
    stale = [path for step, path in steps if step > latest_step]
    for path in older[:max(0, len(older) - (keep - 1))] + stale:
        shutil.rmtree(path, ignore_errors=True)
    for stale in ckpt_root.glob("step_*.tmp"):  # left behind by a crashed save
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none yet."""
    pointer = Path(ckpt_root) / "latest"
    if not pointer.exists():
        return None
    path = Path(ckpt_root) / pointer.read_text().strip()
    if not path.is_dir():
        raise ValueError(f"{pointer} names {path.name}, which does not exist; delete {pointer} to start "
                         "fresh or point it at an existing step_* directory")
    return path


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None, loader=None,
                    restore_rng: bool = True) -> int:
    """Load in place into this layout's (already parallelized) model(s); returns the step stored
    (the number of optimizer steps taken). Arguments as for save_checkpoint. A weights-only
    checkpoint (from `seekforge convert`) leaves the optimizer, scheduler, data position and RNG
    untouched: training continues from those weights as a fresh run."""
    path = Path(path)
    if not (path / ".metadata").exists():
        raise ValueError(f"{path} is not a DCP checkpoint (no .metadata); pass a step_* directory")
    modules = _as_list(model)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata  # flattened: "optim.state..."

    def has(prefix: str) -> bool:
        return any(key.startswith(prefix + ".") for key in saved)

    has_optim = has("optim")
    optimizers = _as_list(optimizer) if optimizer is not None and has_optim else None
    # DCP loads into a template of the same structure (a fresh optimizer gets zero state tensors to
    # load into); ask only for what is there and wanted.
    state = _state(modules, optimizers)
    state["trainer"] = {"step": 0}
    if scheduler is not None and has("trainer.scheduler"):
        state["trainer"]["scheduler"] = scheduler.state_dict()
    if loader is not None and has_optim and has("trainer.loader"):
        state["trainer"]["loader"] = loader.state_dict()
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(path))
    strict = len(modules) == 1  # pipeline stages each take their part of the merged dicts
    for i, module in enumerate(modules):
        if optimizers is None:
            set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
            continue
        # How AdamW steps (fused kernel or per parameter) suits this layout's tensors, not the saving
        # one's: keep it across the load, which restores every param-group entry.
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizers[i].param_groups]
        set_state_dict(module, optimizers[i], model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True, strict=strict))
        for group, kernel in zip(optimizers[i].param_groups, kernels, strict=True):
            group.update(kernel)
    trainer = state["trainer"]
    if not has_optim:
        return int(trainer["step"])
    if "scheduler" in trainer:
        scheduler.load_state_dict(trainer["scheduler"])
    if "loader" in trainer:
        loader.load_state_dict(trainer["loader"])
    local_file = path / f"rank{_rank()}.pt"
    if restore_rng and local_file.exists():
        set_rng_state(torch.load(local_file, weights_only=False)["rng"])  # our own file: python/numpy RNG tuples
    return int(trainer["step"])
