"""Measured memory: the peak of live tensor bytes while some code runs, device-independent.

`LiveBytes` is a TorchDispatchMode that sees every tensor an operator returns, counts each storage
once (views share it) and uncounts it when the storage dies (a weak reference's callback), so on a
CPU it measures what a GPU allocator would hold, minus the allocator's rounding and caching. FSDP
frees and re-gathers parameters by resizing storages in place; those resizes are counted too.

The state a step starts with is passed in (`state_tensors`): parameters, gradients, optimizer states
and, on one process in bf16, train/master.py's persistent bf16 compute copies and fp32 main gradients,
which no operator returns while the step runs (they are written in place) but which are live all along.

`ProfilerLiveBytes` is the reference both are checked against: torch.profiler's allocation record
(every allocation and free of the CPU allocator, started before the model is built), summed in order,
its peak taken inside a marked window (one training step). It sees what no dispatch mode can (storages
made outside any operator); LiveBytes is the cheap, FakeTensor-capable version of the same count.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import contextmanager

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
        # Inputs too: a storage made outside any operator (a collective's C++ buffer, a tensor built
        # before the mode was entered and not passed in) counts from the first op that reads it.
        for t in tree_flatten((out, args, kwargs))[0]:
            self._track(t)
        return out


def state_tensors(modules, optimizers, master_weights=None) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer states: what exists before a step starts; with
    `master_weights` (train/master.MasterWeights) also its bf16 compute copies and fp32 main gradients
    (kept between steps while `p.grad` is None)."""
    tensors = []
    if master_weights is not None:
        tensors += list(master_weights.compute_copies) + [g for g in master_weights.main_grads if g is not None]
    for m in modules:
        tensors += [p for p in m.parameters()] + [p.grad for p in m.parameters() if p.grad is not None]
        tensors += list(m.buffers())
    for opt in optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


class ProfilerLiveBytes:
    """The allocation record's live bytes: `with ProfilerLiveBytes() as ref:` around everything (from
    before the model is built), `with ref.window():` around what is measured; after the outer block,
    `ref.peak` is the most bytes allocated and not yet freed at any point inside the window(s), counting
    everything allocated since the profiler started. CPU allocations (the CPU allocator's record)."""

    WINDOW = "plan.measure.window"

    def __init__(self):
        self.peak = 0
        self._prof = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    @contextmanager
    def window(self):
        with torch.profiler.record_function(self.WINDOW):
            yield

    def __exit__(self, *args):
        self._prof.__exit__(*args)
        events = self._prof.profiler.kineto_results.events()
        windows = [(e.start_ns(), e.end_ns()) for e in events if e.name() == self.WINDOW]
        if not windows:
            raise ValueError("no window was marked: wrap the measured code in `with ref.window():`")
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        live = 0
        for t, nbytes in memory:
            live += nbytes
            if any(a <= t <= b for a, b in windows):
                self.peak = max(self.peak, live)
        return False
