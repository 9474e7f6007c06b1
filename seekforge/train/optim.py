"""AdamW with Megatron's weight-decay split, and the learning-rate schedules as pure functions.

Steps are 0-based optimizer steps: `lr_at(0)` is the rate of the first update, `lr_at(steps - 1)`
of the last, which lands exactly on `min_lr` for both schedules.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from seekforge.config import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and stacked expert weights); never 1-D params — RMSNorm gains and biases —
    whose decay only pulls the scale toward zero (Megatron's `no_weight_decay_cond`)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig):
    """AdamW (decoupled decay, Loshchilov & Hutter) + a LambdaLR driving `lr_at`; both checkpointable."""
    # fused=True is one kernel per dtype on CPU and CUDA alike; torch 2.4+ has it on CPU. One kernel
    # takes one kind of tensor: plain tensors, or DTensors of one mesh (FSDP alone). Layouts that mix
    # them (TP leaves small weights plain, EP puts experts on their own mesh) step per parameter.
    meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in model.parameters()}
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                                  eps=1e-8, fused=len(meshes) == 1, foreach=False if len(meshes) > 1 else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
    return optimizer, scheduler


def follow_schedule(optimizer, scheduler, lr: float) -> None:
    """After a checkpoint is loaded: the schedule is this run's (peak `lr`, the scheduler's factors from its config),
    from the step reached. The checkpoint's scheduler holds the saved run's peak lr and its optimizer the lr of the
    saved run's next step, which would mix the two schedules where a resume changes them (a longer run, another
    lr). The lr is computed as LambdaLR does (base · factor), so that an unchanged run resumes bit for bit."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas,
                                                                        strict=True)]
    for group, group_lr in zip(optimizer.param_groups, lrs, strict=True):
        group["initial_lr"], group["lr"] = lr, group_lr
    scheduler._last_lr = lrs


def clip_grad_norm(parameters, max_norm: float, pp_group=None, duplicates: set[int] = frozenset()) -> torch.Tensor:
    """Scale all gradients by min(1, max_norm / ‖g‖) where ‖g‖ is the global L2 norm over every
    parameter; returns ‖g‖ (a plain scalar tensor). Sharded gradients (FSDP, TP, EP DTensors) count
    by their global tensors: each mesh's norm is reduced by DTensor, then the meshes' norms combine;
    pp_group: the pipeline ranks, whose stages' norms add up; duplicates: ids of parameters that
    repeat another one (a pipeline stage's copy of a tied weight), clipped but not counted."""
    by_mesh: dict = {}  # mesh (None: plain tensors) → parameters with a gradient
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in by_mesh.values():
        grads = [p.grad for p in params if id(p) not in duplicates]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if pp_group is not None:
        squared = total.float() ** 2
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    return lr_schedule(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, steps=cfg.steps,
                       schedule=cfg.schedule, decay_fraction=cfg.decay_fraction)


def lr_schedule(step: int, *, lr: float, min_lr: float, warmup: int, steps: int, schedule: str = "cosine",
                decay_fraction: float = 0.2) -> float:
    """Linear warmup over `warmup` steps (lr·(step+1)/warmup), then
    cosine — min_lr + ½(lr − min_lr)(1 + cos(π·progress)) down to min_lr at the last step;
    wsd   — warmup-stable-decay (MiniCPM, arXiv:2404.06395): hold lr, then decay linearly to min_lr
            over the last ⌈decay_fraction·steps⌉ steps. A run can be extended from any stable-phase
            checkpoint, which is the point of WSD."""
    if step < warmup:
        return lr * (step + 1) / warmup
    last = steps - 1
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, last - warmup))
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_steps = max(1, math.ceil(decay_fraction * steps))
        decay_start = max(warmup, last - decay_steps + 1)
        if step < decay_start:
            return lr
        progress = min(1.0, (step - decay_start + 1) / max(1, last - decay_start + 1))
        return lr + (min_lr - lr) * progress
    raise ValueError(f"schedule={schedule!r}: use 'cosine' or 'wsd'")
