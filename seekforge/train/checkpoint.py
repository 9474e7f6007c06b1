"""Training checkpoints with torch.distributed.checkpoint (DCP): save, exact resume, atomic swap.

Layout under `<out_dir>/checkpoints/`:
    step_000100/        DCP files: model, optimizer, scheduler, step (sharded-tensor aware, so the
                        same code saves an FSDP/TP model, each rank writing its own shards)
    step_000100/config.json  the ModelConfig (HF keys), so a checkpoint rebuilds its own model
    step_000100/rank0.pt  rank-local state: RNG states (torch CPU/CUDA, python, numpy) and the
                        data-loader position — they differ per data-parallel rank
    latest              text file naming the newest complete checkpoint, written last

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
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

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


def save_checkpoint(ckpt_root: str | Path, step: int, model, optimizer=None, scheduler=None, loader=None,
                    keep: int = 2) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep`.
    optimizer=None writes a weights-only checkpoint (what `seekforge convert` makes from HF)."""
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    if _rank() == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = {"model": get_model_state_dict(model), "trainer": {"step": step}}
    if scheduler is not None:
        state["trainer"]["scheduler"] = scheduler.state_dict()
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with _quiet_dcp():
        dcp.save(state, checkpoint_id=str(tmp))
    local = {"rng": rng_state(), "loader": loader.state_dict() if loader is not None else None}
    torch.save(local, tmp / f"rank{_rank()}.pt")
    if _rank() == 0 and hasattr(model, "cfg"):  # self-describing: convert and resume rebuild from it
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
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
    """Load in place; returns the step stored (the number of optimizer steps taken).
    A weights-only checkpoint (from `seekforge convert`) leaves the optimizer, scheduler, data
    position and RNG untouched: training continues from those weights as a fresh run."""
    path = Path(path)
    if not (path / ".metadata").exists():
        raise ValueError(f"{path} is not a DCP checkpoint (no .metadata); pass a step_* directory")
    has_optim = has_optimizer_state(path)
    # DCP loads into a template of the same structure; ask only for what is there and wanted.
    state = {"model": get_model_state_dict(model), "trainer": {"step": 0}}
    if optimizer is not None and has_optim:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if scheduler is not None and has_optim:
        state["trainer"]["scheduler"] = scheduler.state_dict()
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    if not has_optim:
        return int(state["trainer"]["step"])
    trainer = state["trainer"]
    if "scheduler" in trainer:
        scheduler.load_state_dict(trainer["scheduler"])
    local_file = path / f"rank{_rank()}.pt"
    if (loader is not None or restore_rng) and local_file.exists():
        local = torch.load(local_file, weights_only=False)  # our own file: python/numpy RNG tuples
        if restore_rng:
            set_rng_state(local["rng"])
        if loader is not None and local["loader"] is not None:
            loader.load_state_dict(local["loader"])
    return int(trainer["step"])


def has_optimizer_state(path: str | Path) -> bool:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return any(key.startswith("optim.") for key in metadata.state_dict_metadata)
