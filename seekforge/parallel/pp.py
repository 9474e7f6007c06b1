"""Pipeline parallelism with torch.distributed.pipelining: split a built Transformer into stages and
run them under a named schedule.

Stages: the layers are cut at `pp_split_points` (default: an even split). The first stage also holds
the embedding; the last holds the final norm, the head, the MTP modules and computes the loss with the
objective every trainer uses (model/loss.py); the MoE layers' balance loss reaches their routers
through their own backward, in whichever stage they run. Stages compute in bf16 under autocast when
asked (`compute_dtype`), as the single-device trainer does; backward runs outside autocast.
Parameter names inside a stage are the full model's (`layers.5.mlp...`), so checkpoints move between
pipelined and unpipelined layouts unchanged.

Stage placement: single-stage schedules (1F1B, GPipe) put stage r on pp rank r. Interleaved/looped
schedules put stages r, r+pp on rank r; V-shaped schedules (ZBVZeroBubble, DualPipeV) put stages r and
2·pp−1−r on rank r, so the first and the last stage share rank 0.

MTP needs the token embedding on the last stage (DeepSeek-V3 §2.2 shares it with the main model). The
last stage keeps its own copy of `embed_tokens`; after every step the two copies' gradients are summed
(`sync_tied_embedding_grads`), so both copies take identical optimizer steps and stay equal.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from seekforge.config import ParallelConfig
from seekforge.model.dtensor import local_tensor, plain_tensor
from seekforge.model.loss import objective
from seekforge.model.moe import MoE
from seekforge.parallel import cp as cp_module
from seekforge.parallel.mesh import ParallelMesh
from seekforge.parallel.overlap import overlap_dualpipev
from seekforge.parallel.parallelize import parallelize
from seekforge.parallel.tp import loss_context

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


class StageModule(nn.Module):
    """Layers [first_layer, end_layer) of a Transformer, plus the embedding and/or the head parts."""

    def __init__(self, model: nn.Module, first_layer: int, end_layer: int, is_first: bool, is_last: bool):
        super().__init__()
        self.cfg, self.is_first, self.is_last = model.cfg, is_first, is_last
        self.rotary = model.rotary  # buffers only
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first_layer, end_layer)})
        if is_first:
            self.embed_tokens = model.embed_tokens
        if is_last:
            self.norm, self.lm_head, self.mtp = model.norm, model.lm_head, model.mtp
            if len(self.mtp) and not is_first:
                self.embed_tokens = copy.deepcopy(model.embed_tokens)  # MTP's copy; see module docstring
        self.compute_dtype: torch.dtype | None = None  # bf16: autocast the forward, as the trainer does
        self.cp_mesh = None  # context parallelism: this stage sees its cp rank's chunks of every row (parallel/cp.py)

    def _autocast(self, device: torch.device):
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: input ids (B, T); later stages: hidden (B, T, H). Returns hidden (B, T, H)."""
        with self._autocast(x.device):
            if self.is_first:
                x = self.embed_tokens(x)
            positions, attention = self._positions(x.shape[1], x.device)
            cos, sin = self.rotary(positions)
            for layer in self.layers.values():
                x = layer(x, cos, sin, attention)
        return x

    def _positions(self, length: int, device: torch.device):
        """The positions (T,) of this stage's `length` tokens and the attention over them: causal over the row,
        or under cp this rank's global positions and ContextParallelAttention (its keys on every cp rank)."""
        if self.cp_mesh is None:
            return torch.arange(length, device=device), None
        cp = self.cp_mesh.size()
        positions = cp_module.shard_positions(length * cp, cp, self.cp_mesh.get_local_rank(), device)
        return positions, cp_module.ContextParallelAttention(self.cp_mesh.get_group(), positions)

    def loss(self, h: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, mtp_loss_scale: float,
             shifted=None):
        """The objective (model/loss.py) on the final hidden h (B, T, H) → (loss, metrics). Under cp: this rank's
        share, with `shifted` the MTP inputs and targets cut from the full rows (cp.shard_batch)."""
        with self._autocast(h.device):
            positions, attention = self._positions(h.shape[1], h.device)
            reduce = None if self.cp_mesh is None else cp_module.share_of_mean(self.cp_mesh.get_group())
            return objective(self, h, input_ids, labels, self.rotary(positions), attention, None, mtp_loss_scale,
                             shifted or None, reduce)


def stage_layer_ranges(num_layers: int, num_stages: int, split_points: list[int] | None) -> list[tuple[int, int]]:
    """[(first_layer, end_layer)] per stage; split_points are the first layers of stages 1..n-1."""
    if split_points is None:
        split_points = [round(i * num_layers / num_stages) for i in range(1, num_stages)]
    bounds = [0, *split_points, num_layers]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def stage_ids_of_rank(pp_rank: int, pc: ParallelConfig) -> list[int]:
    if pc.stages_per_rank == 1:
        return [pp_rank]
    if pc.pp_schedule in V_SCHEDULES:
        return [pp_rank, pc.num_stages - 1 - pp_rank]
    return [pp_rank + k * pc.pp for k in range(pc.stages_per_rank)]


class PipelineRunner:
    """This rank's stages and the schedule that drives them. `step` runs the forward and backward of
    one batch over all micro-batches; the caller ends the optimizer step's accumulation with
    `sync_tied_embedding_grads` and steps the optimizers."""

    def __init__(self, model: nn.Module, pc: ParallelConfig, mesh: ParallelMesh, mtp_loss_scale: float = 0.3,
                 compute_dtype: torch.dtype | None = None):
        self.pc, self.mesh, self.mtp_loss_scale = pc, mesh, mtp_loss_scale
        self.stage_ids, self.modules = parallel_stages(model, pc, mesh, compute_dtype)
        self.last = next((m for m in self.modules if m.is_last), None)
        self.tied_group = _tied_embedding_group(mesh, pc) if len(model.mtp) else None

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        stages = [PipelineStage(m, i, pc.num_stages, device, group=mesh["pp"].get_group())
                  for m, i in zip(self.modules, self.stage_ids, strict=True)]
        schedule_class = get_schedule_class(pc.pp_schedule)
        single = issubclass(schedule_class, PipelineScheduleSingle)
        # scale_grads=False: the schedule would divide every gradient by the micro-batch count after
        # each step — also what earlier steps of a gradient accumulation left. The loss is scaled instead.
        self.schedule = schedule_class(stages[0] if single else stages, pc.microbatches, loss_fn=self._loss,
                                       scale_grads=False)
        self.loss_scale = 1.0  # d(step loss)/d(one micro-batch's loss), set per step
        self._parts: list[dict[str, torch.Tensor]] = []  # the last stage's loss parts, per micro-batch
        _exclude_metadata_inference(self.schedule, self)

    def _loss(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # target (B, 2, T) carries the input ids along with the labels: MTP needs both on the last stage. Under
        # cp (B, 2 + 2·depths, T/cp): then also each MTP depth's token t+k ids and targets (cp.shard_batch).
        shifted = [(target[:, 2 + 2 * k], target[:, 3 + 2 * k]) for k in range((target.shape[1] - 2) // 2)]
        loss, parts = self.last.loss(h, target[:, 0], target[:, 1], self.mtp_loss_scale, shifted)
        self._parts.append({"loss": loss.detach(), **parts})
        return loss * self.loss_scale

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules for p in module.parameters()]  # stages share no parameter

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, grad_scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Forward and backward of input_ids, labels (B, T), B divisible by microbatches; gradients
        accumulate `grad_scale` × the gradient of the mean micro-batch loss. Returns the mean loss parts
        (`loss`, `lm_loss`, `mtp_loss`) on the rank holding the last stage, {} elsewhere."""
        self._check_batch(input_ids)
        self.loss_scale = grad_scale / self.pc.microbatches
        self._parts = []
        target = torch.stack([input_ids, labels], dim=1)
        if self.pc.cp > 1:  # this cp rank's chunks; its loss share (× cp where FSDP averages over the cp ranks)
            cp_mesh = self.mesh["cp"]
            depths = self.modules[0].cfg.num_nextn_predict_layers if self.mtp_loss_scale > 0 else 0
            input_ids, labels, shifted = cp_module.shard_batch(input_ids, labels, cp_mesh, depths)
            target = torch.stack([input_ids, labels, *(t for pair in shifted for t in pair)], dim=1)
            self.loss_scale *= cp_module.grad_scale(self.modules[0], cp_mesh)
        with loss_context(self.mesh["tp"]):
            self.schedule.step(input_ids, target=target)
        return self._mean_parts()

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The mean loss parts of a held-out batch on the last stage's rank, {} elsewhere; call with the
        stages in eval mode. It runs the training schedule with a zero loss scale, not the schedule's
        `eval`: in torch 2.13 that fails on V-shaped schedules ("can't steal_bwd_input"), and each
        switch between the two modes reruns the shape inference. The zero gradients are dropped."""
        parts = self.step(input_ids, labels, grad_scale=0.0)
        for param in self.parameters():
            param.grad = None
        return parts

    def overlap_f_b(self) -> None:
        """Run each of DualPipeV's overlapped (forward, full backward) pairs at once (parallel/overlap.py)."""
        if self.pc.pp_schedule != "DualPipeV":
            raise ValueError(f"overlap=True under pp needs pp_schedule='DualPipeV' (its overlapped forward/backward "
                             f"pairs); got {self.pc.pp_schedule!r}: switch the schedule or use overlap=False")
        overlap_dualpipev(self.schedule, self.modules)

    def _check_batch(self, input_ids: torch.Tensor) -> None:
        if input_ids.shape[0] % self.pc.microbatches:
            raise ValueError(f"batch size {input_ids.shape[0]} is not divisible by microbatches="
                             f"{self.pc.microbatches}; change either")

    def _mean_parts(self) -> dict[str, torch.Tensor]:
        if not self._parts:
            return {}
        return {k: torch.stack([plain_tensor(p[k]).float() for p in self._parts]).mean() for k in self._parts[0]}

    def sync_tied_embedding_grads(self) -> None:
        """Sum the gradients of the first stage's embedding and the last stage's MTP copy: once per
        optimizer step, after the last `step` of a gradient accumulation."""
        grads = [m.embed_tokens.weight.grad for m in self.modules if hasattr(m, "embed_tokens")]
        grads = [local_tensor(g) for g in grads if g is not None]
        if len(grads) == 2:  # both copies on this rank (V schedules)
            total = grads[0] + grads[1]
            for g in grads:
                g.copy_(total)
        elif len(grads) == 1 and self.tied_group is not None:
            dist.all_reduce(grads[0], group=self.tied_group)


def _exclude_metadata_inference(schedule, runner: PipelineRunner) -> None:
    """On its first step, and again whenever it switches between training and evaluation, a schedule
    infers the stages' shapes by running their forward, the last stage's loss and a backward once more
    (torch 2.13: `_initialize_pp_stages`; a private hook point, hence the guard). That pass is not
    training: its routing must not steer the aux-loss-free bias, its losses must not be logged and
    its gradients must not be applied. All three are restored after it."""
    name = "_initialize_pp_stages"
    initialize = getattr(schedule, name, None)
    if initialize is None:
        return
    moe_layers = [m for module in runner.modules for m in module.modules() if isinstance(m, MoE)]
    params = runner.parameters()

    def excluded(*args, **kwargs):
        saved_moe = [(m.tokens_per_expert.clone(), m.aux_loss) for m in moe_layers]
        saved_grads = [p.grad for p in params]
        saved_parts = list(runner._parts)
        try:
            return initialize(*args, **kwargs)
        finally:
            for moe, (counts, aux_loss) in zip(moe_layers, saved_moe, strict=True):
                moe.tokens_per_expert.copy_(counts)
                moe.aux_loss = aux_loss
            for param, grad in zip(params, saved_grads, strict=True):
                param.grad = grad
            runner._parts = saved_parts

    setattr(schedule, name, excluded)


def _tied_embedding_group(mesh: ParallelMesh, pc: ParallelConfig):
    """The process group joining, for this rank's non-pp coordinates, the pp ranks of the first and
    the last stage; None when they are the same rank. Every rank creates every pair (new_group's rule)."""
    if pc.pp_schedule in V_SCHEDULES or pc.pp == 1:
        return None
    columns = mesh.dense.mesh.reshape(pc.pp, -1)  # (pp, other coordinates) of global ranks
    mine = None
    for j in range(columns.shape[1]):
        pair = [int(columns[0, j]), int(columns[-1, j])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def parallel_stages(model: nn.Module, pc: ParallelConfig, mesh: ParallelMesh,
                    compute_dtype: torch.dtype | None = None) -> tuple[list[int], list[StageModule]]:
    """This pp rank's stage ids and their modules: cut from `model`, each parallelized with its own blocks' share of
    a per-block recompute list (as `plan balance` writes one)."""
    ranges = stage_layer_ranges(model.cfg.num_hidden_layers, pc.num_stages, pc.pp_split_points)
    stage_ids = stage_ids_of_rank(mesh["pp"].get_local_rank(), pc)
    # Cut every stage before parallelizing any: the last stage copies the still-plain embedding.
    modules = [StageModule(model, *ranges[i], i == 0, i == pc.num_stages - 1) for i in stage_ids]
    for module, stage_id in zip(modules, stage_ids, strict=True):
        module.compute_dtype = compute_dtype
        module.cp_mesh = mesh["cp"] if pc.cp > 1 else None
        stage_pc = dataclasses.replace(pc, recompute=_stage_recompute(pc.recompute, *ranges[stage_id], module))
        parallelize(module, stage_pc, mesh)
    return stage_ids, modules


def _stage_recompute(mode: str | list[str], first: int, end: int, module: StageModule):
    """A per-block mode list (main layers, then MTP blocks) cut down to this stage's blocks."""
    if isinstance(mode, str):
        return mode
    num_layers = module.cfg.num_hidden_layers
    return list(mode[first:end]) + (list(mode[num_layers:]) if module.is_last else [])
