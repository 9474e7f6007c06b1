"""Traced memory: run the real model's training step under FakeTensorMode and count what it keeps.

No tensor holds data, so a model of any size traces on a laptop: the parameters, the AdamW states,
every activation the real forward saves and every gradient are fake tensors with real sizes, and
`LiveBytes` (plan/measure.py) records the peak of their storages. Routing is the one data-dependent
step: `torch.bincount` (the tokens per expert) is replaced, inside the trace only, by a balanced
count, which is what the analytic model assumes too (moe_skew = 1).

Layouts: one device, or data-parallel ones (FSDP/HSDP: dp_shard, dp_replicate): `parallelize` runs
on a "fake" process group of the layout's world size (torch's FakeStore; collectives return at once
and move nothing), and this process plays rank 0. Expert parallelism needs the exchanged token
counts, pipelining real point-to-point traffic, and the tensor-parallel loss trips over fake inputs
in DTensor's cross-entropy backward: plan/memory.py covers those layouts.

bf16 on one device follows the trainer (train/master.py): persistent bf16 copies of the matmul weights
and persistent fp32 main gradients (`_MasterWeightsTrace`, the same tensors, its own few lines since plan/
sits below train/); sharded layouts autocast over FSDP2's policy, as the trainer does.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from seekforge.config import ModelConfig, ParallelConfig
from seekforge.model.moe import GroupedExperts
from seekforge.plan.measure import LiveBytes


class _MasterWeightsTrace:
    """train/master.MasterWeights' tensors: a bf16 copy per matmul weight (Linear, stacked experts; not
    one tied to another module), swapped in for forward and backward; its bf16 gradient added into a
    persistent fp32 main gradient when the pass ends."""

    def __init__(self, model: torch.nn.Module):
        linear = (torch.nn.Linear, GroupedExperts)
        others = {id(p) for m in model.modules() if not isinstance(m, linear) for p in m.parameters(recurse=False)}
        self.params = list({id(p): p for m in model.modules() if isinstance(m, linear)
                            for p in m.parameters(recurse=False) if id(p) not in others}.values())
        self.copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in self.params]
        self.main_grads = [None] * len(self.params)

    def tensors(self) -> list[torch.Tensor]:
        return self.copies + [g for g in self.main_grads if g is not None]

    @contextmanager
    def compute(self):
        masters = [p.data for p in self.params]
        torch._foreach_copy_(self.copies, masters)
        for p, copy in zip(self.params, self.copies, strict=True):
            p.grad, p.data = None, copy
        yield
        for i, (p, master) in enumerate(zip(self.params, masters, strict=True)):
            grad, p.grad, p.data = p.grad, None, master
            if grad is not None:
                if self.main_grads[i] is None:
                    self.main_grads[i] = torch.empty_like(grad, dtype=torch.float32)
                p.grad = self.main_grads[i].copy_(grad)


@contextmanager
def _balanced_routing():
    """torch.bincount(x, minlength=E) → E near-equal counts summing to x.numel(), as a real tensor
    (so `.tolist()` works while everything around it is fake)."""
    original = torch.bincount

    def bincount(input, weights=None, minlength=0):
        n, bins = input.numel(), max(minlength, 1)
        with unset_fake_temporarily():
            return torch.tensor([n // bins + (1 if e < n % bins else 0) for e in range(bins)])

    torch.bincount = bincount
    try:
        yield
    finally:
        torch.bincount = original


@contextmanager
def _cpu_autograd_functions():
    """The model takes its CPU autograd Functions (model/moe.py's _SwiGLU, model/model.py's _RMSNorm)
    only for plain tensors, `type(x) is torch.Tensor`, which a FakeTensor is not: the trace would take
    the composite paths, which save more (silu's output, the norm's pieces). Inside the trace the same
    Functions are taken for fake tensors that need gradients."""
    from seekforge.model import model as model_module
    from seekforge.model import moe

    swiglu, norm_forward = moe.swiglu, model_module.RMSNorm.forward

    def traced_swiglu(gate, up=None):
        if torch.is_grad_enabled() and (gate.requires_grad or (up is not None and up.requires_grad)):
            return moe._SwiGLU.apply(gate, up)
        return swiglu(gate, up)

    def traced_norm(self, x):
        if (x.dtype == self.weight.dtype == torch.float32 and torch.is_grad_enabled()
                and (x.requires_grad or self.weight.requires_grad)):
            return model_module._RMSNorm.apply(x, self.weight, self.eps)
        return norm_forward(self, x)

    moe.swiglu, model_module.RMSNorm.forward = traced_swiglu, traced_norm
    try:
        yield
    finally:
        moe.swiglu, model_module.RMSNorm.forward = swiglu, norm_forward


@contextmanager
def _fake_process_group(pc: ParallelConfig | None, cfg: ModelConfig):
    """Yields the layout's mesh on a fake process group (None on one device)."""
    if pc is None or pc.world_size == 1:
        yield None
        return
    if pc.ep > 1 or pc.pp > 1 or pc.tp > 1 or pc.cp > 1:
        raise ValueError(f"the traced mode covers data-parallel layouts (dp_shard, dp_replicate); tp={pc.tp}, "
                         f"ep={pc.ep}, pp={pc.pp}, cp={pc.cp} need real collectives or DTensor losses it cannot "
                         "fake: use the analytic estimate (seekforge plan memory without --traced)")
    if dist.is_initialized():
        raise ValueError("the traced mode creates its own fake process group; run it outside a distributed job")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from seekforge.parallel.mesh import build_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pc.world_size)
    try:
        yield build_mesh(pc, cfg)  # outside FakeTensorMode: the mesh holds real rank tensors
    finally:
        dist.destroy_process_group()


def traced_peak(cfg: ModelConfig, micro_batch_size: int, seq_len: int, dtype: str = "bf16",
                recompute: str = "none", mtp_loss_scale: float = 0.3, pc: ParallelConfig | None = None) -> int:
    """Peak live bytes of rank 0 over the second training step (the first creates the optimizer
    states). micro_batch_size: sequences per data-parallel rank; pc: a layout (its recompute wins)."""
    from seekforge.model.loss import lm_loss
    from seekforge.model.model import Transformer
    from seekforge.parallel.parallelize import parallelize
    from seekforge.parallel.recompute import apply_recompute

    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: use 'bf16' (autocast) or 'fp32'")
    with (_fake_process_group(pc, cfg) as mesh, FakeTensorMode(allow_non_fake_inputs=True), _balanced_routing(),
          _cpu_autograd_functions()):
        model = Transformer(cfg).init_buffers()
        if mesh is not None:
            parallelize(model, pc, mesh)
        elif recompute != "none":
            apply_recompute(model, recompute)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.zeros(micro_batch_size, seq_len + 1, dtype=torch.long)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
        master = _MasterWeightsTrace(model) if dtype == "bf16" and mesh is None else None

        def step():
            with master.compute() if master else nullcontext():
                with autocast:
                    loss, _ = lm_loss(model, ids[:, :-1], ids[:, 1:], mtp_loss_scale=mtp_loss_scale)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        existing = [*model.parameters(), *model.buffers(), *(master.tensors() if master else [])]
        existing += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        with LiveBytes(existing) as tracker:
            step()
    return tracker.peak
