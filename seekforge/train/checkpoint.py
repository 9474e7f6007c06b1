"""Training checkpoints with torch.distributed.checkpoint (DCP): save, exact resume, atomic swap,
for a plain model and a parallelized one alike (FSDP/HSDP, TP, EP DTensors, pipeline stages).

Layout under `<out_dir>/checkpoints/`:
    step_000100/        DCP files: model, optimizer, scheduler, step, data-loader position
    step_000100/config.json  the ModelConfig (HF keys), so a checkpoint rebuilds its own model
    step_000100/rank0.rng.json  rank-local RNG states (torch CPU/CUDA, python, numpy) as JSON
    step_000100/manifest.json   every other file's size and sha256, written last (train/integrity.py)
    step_000100/layout.json  the saving layout: every weight's placement (parallel/layout.Layout)
    latest              text file naming the newest complete checkpoint, written last

Nothing is unpickled freely: RNG states and the config are JSON, and DCP's own unpickling (its
.metadata and non-tensor values) goes through train/safe_dcp.py's restricted readers, so loading
someone else's checkpoint cannot run their code.

Any layout → any layout: `get_state_dict` names every weight and optimizer state by its full-model
name ("layers.3.mlp...", "state.layers.3.mlp....exp_avg", flattened so pipeline stages merge by
plain dict union) and keeps sharded tensors as DTensors with their global shapes; DCP writes each
shard once and reshards on load. So a run saved on 4 ranks (FSDP × TP × EP) resumes on a 2-rank
pipeline or on one process, and `seekforge convert` reads it without a process group. The loader
position is the global batch counter (data/dataset.BatchLoader), the same on every rank, so it is
stored once in the DCP state; RNG states are per rank and restored only where the rank existed.

Atomicity: everything is written into `step_000100.tmp/`, the manifest last, and the directory is
renamed only when complete; `latest` is replaced with os.replace after that. A crash at any point
leaves `latest` naming a complete checkpoint (a stale `.tmp` directory is ignored and cleaned up by
the next save). A save that fails (disk full, no permission) removes its `.tmp` and raises
CheckpointSaveError; the previous checkpoint and `latest` stay as they were.

Trust at resume: latest_checkpoint() checks the checkpoint `latest` names against its manifest;
a damaged one is named with its bad file and the reason, and (unless fallback=False) the newest
intact older checkpoint is used instead, with one warning line.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import shutil
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from seekforge.config import ModelConfig
from seekforge.errors import CorruptFileError, UserError
from seekforge.parallel.layout import layout_of_model
from seekforge.train import integrity
from seekforge.train.safe_dcp import SafePlanner, SafeReader

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
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))  # torchrun's rank, before the process group exists


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _bytes_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """This process's RNG states as JSON-ready values (no pickle): torch's byte states in base64,
    python's Mersenne Twister tuple and numpy's as lists."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": _b64(torch.get_rng_state()), "python": [version, list(mt), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in state["cuda"]])


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


class CheckpointSaveError(UserError):
    """A save failed for a reason outside the program (disk full, no permission); nothing older changed."""


def _agree(ok: bool) -> bool:
    """True only if every rank's local step succeeded, so all ranks take the same branch (a rank that
    failed alone would otherwise leave the others waiting in the next barrier)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _root_cause(e: BaseException) -> BaseException:
    """DCP wraps each rank's failure in a CheckpointException; the OSError inside says why."""
    if isinstance(e, CheckpointException) and e.failures:
        failure = next(iter(e.failures.values()))
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        return _root_cause(inner) if isinstance(inner, BaseException) else e
    return e


def save_checkpoint(ckpt_root: str | Path, step: int, model, optimizer=None, scheduler=None, loader=None,
                    keep: int = 2) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep`. Every rank
    calls it. model / optimizer: a module and its optimizer, or parallel lists of this rank's
    pipeline stages and their optimizers. optimizer=None writes a weights-only checkpoint (what
    `seekforge convert` makes from HF). Raises CheckpointSaveError (on every rank) when the files
    cannot be written; the previous checkpoint and `latest` are then untouched."""
    modules = _as_list(model)
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    state = _state(modules, None if optimizer is None else _as_list(optimizer))
    state["trainer"] = {"step": step}
    if scheduler is not None:
        state["trainer"]["scheduler"] = scheduler.state_dict()
    if loader is not None:
        state["trainer"]["loader"] = loader.state_dict()
    layout = layout_of_model(modules)  # collective: every rank's placements, before any rank can fail alone
    error = None
    try:
        if _rank() == 0:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except OSError as e:
        error = e
    if _agree(error is None):
        try:
            with _quiet_dcp():
                dcp.save(state, checkpoint_id=str(tmp))  # collective; raises on every rank if one fails
            (tmp / f"rank{_rank()}.rng.json").write_text(json.dumps(rng_state()))
            if _rank() == 0:  # where each weight lived when saved (parallel/layout.py); DCP itself needs no layout
                layout.save(tmp / "layout.json")
            if _rank() == 0 and hasattr(modules[0], "cfg"):  # self-describing: convert and resume rebuild from it
                (tmp / "config.json").write_text(json.dumps(modules[0].cfg.to_hf(), indent=2))
        except (OSError, CheckpointException) as e:
            error = _root_cause(e)
            if not isinstance(error, OSError):
                raise
    if _agree(error is None) and _rank() == 0:
        try:
            integrity.write_manifest(tmp, step)  # last: its presence means every listed byte is there
        except OSError as e:
            error = e
    if not _agree(error is None):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free what the failed save took
        previous = latest_checkpoint(ckpt_root, verify=False) if (ckpt_root / "latest").exists() else None
        kept = f"{previous.name} and `latest` are untouched" if previous else "there is no earlier checkpoint"
        cause = f"{type(error).__name__}: {error}" if error is not None else "another rank failed to write its part"
        raise CheckpointSaveError(f"could not save checkpoint {final}: {cause}; {kept}. Free disk space or fix the "
                                  f"permissions of {ckpt_root}, then rerun the same command to resume")
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


def _warn(message: str) -> None:
    if _rank() == 0:  # every rank reaches the same verdict; one line is enough
        print(f"seekforge: warning: {message}", file=sys.stderr, flush=True)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def step_dirs(ckpt_root: Path) -> list[Path]:
    """step_* directories, newest first."""
    steps = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def interrupt_hint(out_dir: str | Path, save_interval: int) -> str:
    """What an interrupted run's user is told: how to go on from its last checkpoint, or that none is saved yet."""
    root = Path(out_dir) / "checkpoints"
    saved = step_dirs(root) if root.is_dir() else []
    if saved:
        return (f"rerun the same command to resume from the run's last checkpoint, {saved[0].name} "
                "(--set save_interval=N: how often)")
    when = f"one every {save_interval} steps" if save_interval else "one at the end only"
    return (f"no checkpoint is saved yet (save_interval={save_interval}: {when}), so a rerun starts over; "
            "--set save_interval=N saves sooner")


def latest_checkpoint(ckpt_root: str | Path, fallback: bool = True, verify: bool = True) -> Path | None:
    """The checkpoint to resume from: the one `latest` names, checked against its manifest; None when
    there is none yet. A damaged one raises CorruptFileError (file and reason) when fallback=False;
    with fallback=True the newest intact older checkpoint is returned with one warning line. Without a
    `latest` file (lost, or deleted by hand) the newest step_* directory stands for it, with a warning:
    a run is never taken for a fresh one while checkpoints of it exist."""
    ckpt_root = Path(ckpt_root)
    pointer = ckpt_root / "latest"
    if pointer.exists():
        named = ckpt_root / pointer.read_text().strip()
    else:
        steps = step_dirs(ckpt_root) if ckpt_root.is_dir() else []
        if not steps:
            return None
        named = steps[0]
        _warn(f"{pointer} is missing; taking the newest checkpoint directory, {named.name}, for it")
    if not verify:
        return named
    if not _STEP_DIR.match(named.name):
        verdict = integrity.Verdict(named, "corrupt", pointer, f"names {named.name!r}, not a step_* directory")
    else:
        verdict = integrity.verify(named)
    if verdict.usable:
        return named
    problem = f"checkpoint {named.name} is damaged: {verdict.file}: {verdict.reason}"
    named_step = int(m.group(1)) if (m := _STEP_DIR.match(named.name)) else None
    older = [p for p in step_dirs(ckpt_root) if named_step is None or _step_of(p) < named_step]
    intact = next((p for p in older if integrity.verify(p).usable), None)
    if intact is None:  # nothing to fall back to: only starting over (or another run name) helps
        raise CorruptFileError(verdict.file, verdict.reason,
                               f"checkpoint {named.name} is damaged and no older intact checkpoint exists under "
                               f"{ckpt_root}; rerun with --no-resume to start fresh (or --name NEW for a new run)")
    if not fallback:
        raise CorruptFileError(verdict.file, verdict.reason,
                               f"checkpoint {named.name} is damaged. Drop --no-checkpoint-fallback to resume from "
                               f"{intact.name}, the newest intact older checkpoint, or pass --no-resume to start fresh")
    _warn(f"{problem}; resuming from {intact.name} instead")
    return intact


def latest_pointer_problem(ckpt_root: Path) -> str | None:
    """What is wrong with ckpt_root/latest, if anything: it must name a step_* directory that exists
    (a missing `latest` is not a problem: resume takes the newest step_* directory for it)."""
    pointer = ckpt_root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if _STEP_DIR.match(name) and (ckpt_root / name).is_dir():
        return None
    newest = step_dirs(ckpt_root)[:1]
    fix = f"point it at one (echo {newest[0].name} > {pointer})" if newest else "delete it"
    return f"{pointer} names {name!r}, which is not a checkpoint directory here; {fix}"


# Set by the tokenizer (vocabulary, special ids), carried for HF round trips only (MLA ignores num_key_value_heads;
# an HF export writes num_attention_heads there), or not the model's shape (extra).
_NOT_ASKED_FOR = ("vocab_size", "bos_token_id", "eos_token_id", "num_key_value_heads", "extra")


def check_resumed_model(out_dir: str | Path, asked: ModelConfig | dict[str, Any], named_by: str,
                        new_run: str = "--name NAME") -> None:
    """Refuse to resume out_dir's run when its model is not the one asked for: resuming keeps the stored model, so
    the user would silently train another. `asked`: a whole model that `named_by` (e.g. --preset small) names, or
    only the model keys a config sets. `new_run`: the verb's flag for a run of its own."""
    ckpt_root = Path(out_dir) / "checkpoints"
    latest = latest_checkpoint(ckpt_root, verify=False) if ckpt_root.is_dir() else None
    if latest is None or not (latest / "config.json").exists():
        return
    stored = ModelConfig.from_hf(latest)
    if isinstance(asked, ModelConfig):
        asked = {f.name: getattr(asked, f.name) for f in dataclasses.fields(ModelConfig)
                 if f.name not in _NOT_ASKED_FOR}
    differ = [key for key, value in asked.items() if getattr(stored, key, value) != value]
    if differ:
        def listed(values):
            return ", ".join(f"{k}={values[k]!r}" for k in differ[:3]) + (", …" if len(differ) > 3 else "")

        raise UserError(f"{out_dir} holds a run of another model: it has {listed(vars(stored))} ({latest.name}); "
                        f"{named_by} asks for {listed(asked)}. A resumed run keeps its model: pass {new_run} "
                        f"for a new run, or --no-resume to start {out_dir} over")


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
    saved = SafeReader(str(path)).read_metadata().state_dict_metadata  # flattened: "optim.state..."

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
        # Only the keys the checkpoint has: the loader's load_state_dict then says what differs (another dataset,
        # another version of it) in its own words, instead of DCP failing on a missing key.
        state["trainer"]["loader"] = {k: v for k, v in loader.state_dict().items() if f"trainer.loader.{k}" in saved}
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if (path / integrity.MANIFEST).exists():
            raise  # a checkpoint the manifest vouches for failing to load is a bug: traceback
        cause = _root_cause(e)
        raise CorruptFileError(path, f"cannot be read ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})",
                               "it has no manifest.json to tell which file is damaged; resume from an older "
                               "step_* directory or start fresh with --no-resume") from e
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
    local_file = path / f"rank{_rank()}.rng.json"
    if restore_rng and local_file.exists():
        set_rng_state(json.loads(local_file.read_text()))
    return int(trainer["step"])
