"""Overlap of one micro-batch's expert all-to-all with another micro-batch's compute (issue 44, part 4).

Gradient accumulation runs the forward of micro-batch i+1 on the calling thread while the backward of
micro-batch i runs on a worker thread (1F1B's steady state for one stage): whenever one waits for an
all-to-all, the other computes. The exchanges themselves already run on gloo's own threads (CPU) or on
the communicator's stream (GPU): both sides only need to be free to do something else while waiting.

Order and results. Backward i still finishes before backward i+1 starts, and every backward starts
from zero unsharded gradients that are then reduced and added to the sharded ones one micro-batch at a
time, as FSDP does; so the gradients, hence the losses and weights, are bit-identical to running the
micro-batches one after the other (tests/dist/test_ep_overlap.py).

Comm lanes. Two threads issuing collectives on one process group could issue them in different orders
on different ranks (a deadlock, or two exchanges mixed up). So micro-batch i talks on lane i % 2: the
expert dispatchers (parallel/ep.py) pick their process group through `lane_group` when the forward
builds an exchange, and the exchange's backward reuses it. Lane 0 is the model's own groups, lane 1 a
twin of each (`create_lanes`, the same ranks). Within a lane the collectives keep program order: the
forward of i+2 starts after the backward of i has finished. Recompute (checkpoint_wrapper) reruns
the forward inside the backward, so the worker sets its micro-batch's lane too.

FSDP. Its hooks assume a module's forward and backward never interleave (its per-module state would be
corrupted), so while overlapping `fsdp_unsharded` gathers every parameter once, takes FSDP's forward
hooks off (nothing else of FSDP runs: its backward hooks are registered by the forward ones), and
reduce-scatters each micro-batch's gradients with FSDP's own post-backward, between backwards, on the
calling thread while the worker is idle: the data-parallel group is never used by two threads (with
dp_shard = ep it is the very group object of the expert exchanges: DeviceMesh shares groups of the same
ranks). So that reduce-scatter is not hidden. Mixed precision (FSDP's bf16 parameters) is not supported
here: its forward-input casts are forward hooks.

Pipelines (DualPipeV, `overlap_dualpipev`): the schedule's OVERLAP_F_B actions already pair a forward of
one of the rank's two stages with a full backward of the other; the pair runs the same way, each stage on
its own lane for everything it sends (its expert exchanges and, under FSDP, its all-gathers and
reduce-scatters, moved to the lane's twin groups). Each stage is its own FSDP root, so FSDP's per-module
state is never touched by both threads.

GPU (not measured: no GPU here). Both threads queue their kernels on the device's current stream, which
is correct (the caching allocator's reuse stays ordered) but overlaps only the host's work and the waits,
not kernels; a side stream for the backward would need its saved tensors' frees ordered after its kernels
(record_stream), not done yet. The autograd engine runs GPU backwards on its device threads, which do not
see a thread's lane, so recompute there would use lane 0: with recompute, overlap is CPU-only for now
(`check_supported`).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

_local = threading.local()  # .lane: this thread's comm lane (0 when unset)
_twins: dict = {}  # process group → its lane-1 twin (same ranks)


def lane_group(group):
    """The process group a collective meant for `group` uses on this thread's lane."""
    if getattr(_local, "lane", 0) == 0 or group is None:
        return group
    twin = _twins.get(group)
    assert twin is not None, "comm lane 1 used before create_lanes() made a twin of this group"
    return twin


@contextmanager
def comm_lane(lane: int) -> Iterator[None]:
    """Collectives built on this thread inside the block use `lane` (0 or 1)."""
    previous = getattr(_local, "lane", 0)
    _local.lane = lane
    try:
        yield
    finally:
        _local.lane = previous


def create_lanes(groups) -> None:
    """Make a lane-1 twin of each of `groups` (once per group). Collective over the world: every rank
    calls it, each with its own groups; each rank then creates every twin any rank needs, in one
    order (dist.new_group's rule)."""
    mine = []
    for group in groups:
        if group is not None and group not in _twins and group not in mine:
            mine.append(group)
    ranks = [tuple(dist.get_process_group_ranks(g)) for g in mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    created = {r: dist.new_group(list(r)) for r in sorted({r for per_rank in everyone for r in per_rank})}
    for group, r in zip(mine, ranks, strict=True):
        _twins[group] = created[r]


def expert_groups(modules: list[nn.Module]) -> list:
    """The process groups the MoE layers' expert dispatchers of `modules` exchange over."""
    return [g for module in modules for m in module.modules()
            for g in getattr(getattr(m, "dispatcher", None), "comm_groups", list)()]


def accumulate(num: int, forward: Callable[[int], torch.Tensor], backward: Callable[[torch.Tensor], None],
               between: Callable[[], None] = lambda: None, concurrent: bool = True) -> None:
    """forward(i) → the tensor to differentiate, for micro-batches i < num; backward(t) accumulates its
    gradients; `between` runs on the calling thread after each backward (FSDP's reduce-scatter).
    Runs F0, then F(i) alongside B(i-1) for i ≥ 1, then B(num-1): the gradients of the sequential order.
    concurrent=False runs B(i-1) before F(i) on the calling thread: the same work, lanes and FSDP handling
    without the overlap (benchmarks/ep_overlap.py's control for what the concurrency alone buys)."""
    with comm_lane(0):
        pending = forward(0)
    for i in range(1, num):
        job = None
        if concurrent:
            job = _worker().submit(_backward_in_lane, backward, pending, (i - 1) % 2)
        else:
            _backward_in_lane(backward, pending, (i - 1) % 2)
        try:
            with comm_lane(i % 2):
                pending = forward(i)
        finally:
            if job is not None:
                job.result()  # also when the forward failed: never leave a backward running
        between()
    with comm_lane((num - 1) % 2):
        backward(pending)
    between()


def overlap_dualpipev(schedule, modules: list[nn.Module]) -> None:
    """Run each OVERLAP_F_B action of a DualPipeV `schedule` (a forward of one of this rank's two stages and a
    full backward of the other, different micro-batches) as a forward on the calling thread beside the backward
    on the worker. `modules`: this rank's stage modules, in the schedule's stage order. Stage j talks on lane j,
    everything included: its forwards set the lane with a hook (its backwards reuse the forward's groups) and
    under FSDP its all-gathers and reduce-scatters move to the lane's twin groups, so the two stages never share
    a process group. Collective over the world (create_lanes)."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    lanes, moved = {}, []
    for lane, (stage, module) in enumerate(zip(schedule._stages, modules, strict=True)):
        lanes[stage.stage_index] = lane
        module.register_forward_pre_hook(lambda *_, lane=lane: _push_lane(lane))
        module.register_forward_hook(lambda *_: _pop_lane(), always_call=True)
        if lane:
            moved += _fsdp_groups(module)
    create_lanes(expert_groups(modules) + [getattr(info, name) for info, name in moved])
    for info, name in moved:
        setattr(info, name, _twins[getattr(info, name)])
    schedule.register_custom_function(OVERLAP_F_B, lambda action, ctx: _overlap_f_b(action, ctx, lanes))


def _fsdp_groups(module: nn.Module) -> list[tuple[object, str]]:
    """(FSDP mesh info, attribute) of every process group the FSDP parameter groups in `module` use."""
    from torch.distributed.fsdp import FSDPModule

    infos = {id(info): info for m in module.modules() if isinstance(m, FSDPModule)
             for g in m._get_fsdp_state()._fsdp_param_groups for info in (g.mesh_info, g.post_forward_mesh_info)
             if info is not None}
    names = ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group")
    return [(info, name) for info in infos.values() for name in names if getattr(info, name, None) is not None]


def _push_lane(lane: int) -> None:
    _local.stack = [*getattr(_local, "stack", []), getattr(_local, "lane", 0)]
    _local.lane = lane


def _pop_lane() -> None:
    *_local.stack, _local.lane = _local.stack


def _overlap_f_b(action, ctx, lanes: dict[int, int]) -> None:
    """torch 2.13 _PipelineScheduleRuntime's FORWARD and FULL_BACKWARD actions (its _step_microbatches), the
    two of one OVERLAP_F_B at once; the hand-offs between this rank's adjacent stages after both."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    sched, (fwd, bwd) = ctx.schedule_ref, action.sub_actions
    stages = {s.stage_index: s for s in sched._stages}
    f_stage, b_stage, f_mb, b_mb = stages[fwd.stage_index], stages[bwd.stage_index], fwd.microbatch_index, \
        bwd.microbatch_index
    sched._assert_unsharded(f_stage)
    sched._assert_unsharded(b_stage)
    if not f_stage.is_first and fwd.stage_index - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
    if not b_stage.is_last and bwd.stage_index + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((bwd.stage_index, b_mb)))
    sched.backward_counter[bwd.stage_index] += 1
    last = sched.backward_counter[bwd.stage_index] == sched._n_microbatches

    def backward() -> None:
        with comm_lane(lanes[bwd.stage_index]):
            loss = sched._maybe_get_loss(b_stage, b_mb)
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)

    def forward() -> torch.Tensor:
        output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb], save_forward_output=True)
        sched._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
        return output

    job = _worker().submit(backward)
    try:
        output = forward()
    finally:
        job.result()
    if fwd.stage_index + 1 in stages:  # see torch's [Note: V-schedule special case]
        stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)
    if bwd.stage_index - 1 in stages:
        stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)


def _worker() -> ThreadPoolExecutor:
    """The one thread backwards run on beside a forward (made on first use, kept for the process)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="overlap-backward")
    return _pool


_pool: ThreadPoolExecutor | None = None


def _backward_in_lane(backward, loss: torch.Tensor, lane: int) -> None:
    with comm_lane(lane):
        backward(loss)


@contextmanager
def fsdp_unsharded(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Hold every FSDP parameter of `model` (its FSDP root, or a plain module: nothing to do) unsharded
    with FSDP's forward hooks off; yields `reduce`, FSDP's post-backward for every parameter group (the
    reduce-scatter of one micro-batch's unsharded gradients into the sharded ones). On exit FSDP's
    end-of-backward bookkeeping runs, the parameters are resharded and the hooks are back. FSDP mixed precision
    is not supported (`check_supported` refuses it)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield lambda: None
        return
    root = model._get_fsdp_state()
    root._lazy_init()  # normally done by the root's first forward hook, which is about to be off
    states = root._state_ctx.all_states
    groups = [g for s in states for g in s._fsdp_param_groups]
    restore = _hooks_off(states)
    reshard_after = [g.reshard_after_backward for g in groups]
    try:
        for g in groups:
            g.reshard_after_backward = False  # the next micro-batch's forward is still using them
            g.unshard()
            g.wait_for_unshard()

        def reduce() -> None:
            for state in reversed(states):  # backward's order
                for g in reversed(state._fsdp_param_groups):
                    g.post_backward()

        yield reduce
        root._root_post_backward_final_callback()  # what FSDP runs at the end of a backward
    finally:
        for g, after in zip(groups, reshard_after, strict=True):
            g.reshard_after_backward = after
            g.reshard()
        restore()


def check_supported(modules: list[nn.Module], device: torch.device, pipelined: bool) -> None:
    """Refuse what overlap cannot run: recompute on a GPU (see the module's GPU note) and, outside a pipeline,
    FSDP mixed precision (bf16 parameters: FSDP casts the forward inputs in the hooks `fsdp_unsharded` takes off)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    every = [m for module in modules for m in module.modules()]
    if device.type != "cpu" and any(isinstance(m, CheckpointWrapper) for m in every):
        raise ValueError("overlap=True with recompute on a GPU is not supported yet (the recomputed forward would "
                         "not see its micro-batch's comm lane); use recompute='none' or overlap=False")
    if not pipelined and any(isinstance(m, FSDPModule) and m._get_fsdp_state()._mp_policy.param_dtype
                             not in (None, torch.float32) for m in every):
        raise ValueError("overlap=True with FSDP mixed precision (bf16 parameters) is not supported: FSDP casts the "
                         "forward inputs in hooks overlap must take off; use mixed_precision='fp32' or overlap=False")


def _hooks_off(states) -> Callable[[], None]:
    """Take FSDP's forward hooks (and methods registered with register_fsdp_forward_method) off
    `states`' modules; returns the function putting them back as they were, in their order."""
    saved_dicts: dict[int, tuple[dict, list]] = {}
    saved_methods = []
    for state in states:
        for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
            for h in getattr(handle, "handles", (handle,)):
                hooks = h.hooks_dict_ref()
                if hooks is not None:
                    saved_dicts.setdefault(id(hooks), (hooks, list(hooks.items())))
                    hooks.pop(h.id, None)
        for module in state._modules:
            for name, value in list(vars(module).items()):
                if isinstance(value, types.MethodType) and hasattr(value.__func__, "__wrapped__"):
                    saved_methods.append((module, name, value))
                    delattr(module, name)  # the class's own method again

    def restore() -> None:
        for hooks, items in saved_dicts.values():
            hooks.clear()
            hooks.update(items)
        for module, name, value in saved_methods:
            setattr(module, name, value)

    return restore
