"""Measured memory: the peak of live tensor bytes while some code runs, device-independent.

`LiveBytes` is a TorchDispatchMode that sees every tensor an operator returns, counts each storage
once (views share it) and uncounts it when the storage dies (a weak reference's callback), so on a
CPU it measures what a GPU allocator would hold, minus the allocator's rounding and caching. FSDP
frees and re-gathers parameters by resizing storages in place; those resizes are counted too.

This is the oracle the analytic estimates of plan/memory.py are checked against.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """with LiveBytes(existing_tensors) as m: ...; m.peak is the most bytes alive at once, counting the
    storages of `existing_tensors` (parameters, optimizer states) from the start."""

    def __init__(self, existing: Iterable[torch.Tensor] = (), unbacked_size: int | None = None):
        """unbacked_size: under FakeTensorMode (plan/traced.py), the value given to every
        data-dependent size (the tokens one expert receives), which has no value to read there."""
        super().__init__()
        self.unbacked_size = unbacked_size
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage id → bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._existing = list(existing)
        self._resize = None

    def _track(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if hasattr(t, "_local_tensor"):  # a DTensor: its local shard is what this rank holds
            t = t._local_tensor
        st = t.untyped_storage()
        key = st._cdata
        if key in self._sizes:
            return
        nbytes = self._concrete(st.nbytes())
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._forget(key))
        self._add(nbytes)

    def _concrete(self, nbytes) -> int:
        if isinstance(nbytes, int):
            return nbytes
        expr = nbytes.node.expr  # a SymInt: substitute the data-dependent symbols
        if self.unbacked_size is None:
            raise ValueError("a tensor's size depends on data; pass unbacked_size (expected tokens per expert)")
        return int(expr.subs({symbol: self.unbacked_size for symbol in expr.free_symbols}))

    def _forget(self, key: int) -> None:
        self._refs.pop(key, None)
        self.live -= self._sizes.pop(key, 0)

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __enter__(self):
        for t in self._existing:
            self._track(t)
        self._existing = []
        original = torch.UntypedStorage.resize_
        self._resize = original

        def resize_(st, size):
            key = st._cdata
            before = self._concrete(st.nbytes())
            out = original(st, size)
            if key in self._sizes:
                self._sizes[key] = self._concrete(st.nbytes())
                self._add(self._sizes[key] - before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out


def state_tensors(modules, optimizers) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer states: what exists before a step starts."""
    tensors = []
    for m in modules:
        tensors += [p for p in m.parameters()] + [p.grad for p in m.parameters() if p.grad is not None]
        tensors += list(m.buffers())
    for opt in optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors
