"""bf16 compute weights over fp32 master weights: Megatron's mixed-precision optimizer, on one process.

Autocast over fp32 parameters makes a fresh bf16 copy of every matmul weight at each forward and casts
each weight's bf16 gradient back to an fp32 copy in backward. Here every matmul weight (the Linear
layers' and the stacked experts') keeps one persistent bf16 copy, refreshed from its fp32 master at the
start of each forward/backward; inside `MasterWeights.compute()` the parameter *is* that copy, so the
forward uses it without a cast and backward leaves a bf16 gradient, which is added into the fp32 main
gradient when the pass ends (fp32 accumulation over micro-batches, as Megatron's main_grad: one
persistent fp32 buffer per weight, so a step does not fault a fresh gradient's pages in). Outside
that context the parameters hold their fp32 masters again with fp32 gradients, so clipping, AdamW,
checkpoints (exact resume) and the HF export see exactly what they saw under autocast.

Numerically this is the autocast step, bit for bit: the forward sees the same bf16 rounding of the same
masters, the weight gradients are the same bf16 values (autocast computed them in bf16 too, then cast
them up), and clipping and AdamW run on the same fp32 numbers.

Not swapped: the embedding (a lookup, and its fp32 output keeps the residual stream fp32, as under
autocast), the norms (fp32 gains) and the router (fp32 by design). Sharded parameters (FSDP, TP, EP
DTensors) are not handled here: FSDP2's MixedPrecisionPolicy does the same job for them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from seekforge.model.moe import GroupedExperts


def matmul_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The fp32 parameters that only ever enter matmuls: Linear weights and biases and the stacked
    expert weights, minus any tied to another module (a tied embedding stays fp32)."""
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear | GroupedExperts)
              for p in m.parameters(recurse=False)}
    chosen, seen = [], set()
    for module in model.modules():
        if isinstance(module, nn.Linear | GroupedExperts):
            for p in module.parameters(recurse=False):
                if p.dtype == torch.float32 and id(p) not in others and id(p) not in seen:
                    seen.add(id(p))
                    chosen.append(p)
    return chosen


def can_use_master_weights(model: nn.Module) -> bool:
    """A plain (unsharded) module: DTensor parameters go through FSDP2's own mixed precision."""
    return isinstance(model, nn.Module) and not any(isinstance(p, DTensor) for p in model.parameters())


class MasterWeights:
    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, copies: nn.Module | None = None):
        """copies: a replica of `model` in `dtype` whose matmul parameters serve as the compute copies
        (GRPO's rollout engine holds one: no second bf16 copy); they are overwritten on every refresh."""
        self.params = matmul_parameters(model)
        if copies is None:
            self.compute_copies = [torch.empty_like(p, dtype=dtype) for p in self.params]
        else:
            names = {id(p): name for name, p in model.named_parameters()}
            replica = dict(copies.named_parameters())
            self.compute_copies = [replica[names[id(p)]].data for p in self.params]
            pairs = zip(self.compute_copies, self.params, strict=True)
            if any(c.dtype != dtype or c.shape != p.shape for c, p in pairs):
                raise ValueError(f"the replica's matmul parameters are not {dtype} copies of the model's")
        # The fp32 main gradients, allocated on first use and kept: a step's first pass copies into them
        # rather than into fresh tensors (a cast into new memory faults its pages in, an order of magnitude
        # slower than into memory already mapped: git log -p BENCHMARKS.md, Train step). Between steps they hold the
        # last step's values; the optimizer's zero_grad(set_to_none=True) only drops `p.grad`.
        self.main_grads: list[torch.Tensor | None] = [None] * len(self.params)

    @contextmanager
    def compute(self, refresh: bool = True):
        """Within: every matmul parameter is its bf16 copy (refreshed from the master on entry) with no
        gradient; on exit its fp32 master is back and its bf16 gradient, if any, is added into the fp32
        gradient it had on entry (or becomes it). `refresh=False`: the masters have not changed since the
        last entry (several forward/backward passes between two optimizer steps), so the copies are kept."""
        masters = [p.data for p in self.params]  # fp32; read at each entry: a resume may have replaced them
        main_grads = [p.grad for p in self.params]
        if refresh:
            torch._foreach_copy_(self.compute_copies, masters)  # rounds to nearest, as autocast's cast does
        for p, copy in zip(self.params, self.compute_copies, strict=True):
            p.grad = None
            p.data = copy
        try:
            yield
        finally:
            for i, (p, master) in enumerate(zip(self.params, masters, strict=True)):
                grad = p.grad
                p.grad = None
                p.data = master
                if grad is not None:
                    main_grads[i] = self._main_grad(i, grad) if main_grads[i] is None else main_grads[i].add_(grad)
                p.grad = main_grads[i]

    def _main_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """grad in fp32, written into parameter i's persistent buffer."""
        buffer = self.main_grads[i]
        if buffer is None or buffer.shape != grad.shape or buffer.device != grad.device:
            buffer = self.main_grads[i] = torch.empty_like(grad, dtype=torch.float32)
        return buffer.copy_(grad)
