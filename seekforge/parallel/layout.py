"""Checkpoints that move between parallel layouts (torch.distributed.checkpoint).

A checkpoint stores every weight and optimizer state under its full-model name ("layers.3.mlp...",
"state.layers.3.mlp....exp_avg"), as DTensor shards with their global shapes. DCP reshards on
load, so a checkpoint written under one layout (FSDP × TP × EP on 4 ranks, say) loads under any
other (a 2-rank pipeline, or a single process): same names, same global tensors.

`modules` / `optimizers` are parallel lists: one module and its optimizer per pipeline stage held by
this rank (PipelineRunner.modules), or a single parallelized model and its optimizer.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

# Flat optimizer keys ("state.<fqn>.exp_avg") merge across pipeline stages by plain dict union.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    model_state, optim_state = {}, {}
    for module, optimizer in zip(modules, optimizers, strict=True):
        m, o = get_state_dict(module, optimizer, options=_OPTIONS)
        model_state.update(m)
        optim_state.update(o)
    return {"model": model_state, "optim": optim_state}


def save_checkpoint(path: str, modules: nn.Module | list[nn.Module],
                    optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> None:
    """Every rank calls this; DCP writes each shard once (replicas are deduplicated)."""
    modules, optimizers = _as_list(modules), _as_list(optimizers)
    dcp.save(_state(modules, optimizers), checkpoint_id=path)


def load_checkpoint(path: str, modules: nn.Module | list[nn.Module],
                    optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> None:
    """Load into this layout's (already parallelized) modules and optimizers, in place."""
    modules, optimizers = _as_list(modules), _as_list(optimizers)
    state = _state(modules, optimizers)  # a fresh optimizer gets zero state tensors to load into
    dcp.load(state, checkpoint_id=path)
    for module, optimizer in zip(modules, optimizers, strict=True):
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_OPTIONS)


def _as_list(x):
    return list(x) if isinstance(x, list | tuple) else [x]
