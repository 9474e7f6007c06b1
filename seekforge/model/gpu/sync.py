"""Host syncs and op counts of a step, seen from torch's dispatcher.

A GPU step that copies a value to the host (`.item()`, `.tolist()`, `bool(t)`, an op whose output size depends
on tensor values: `nonzero`, boolean indexing, `bincount`, `repeat_interleave` without its size) waits for every
kernel queued before it: the CPU stops issuing kernels and the GPU runs dry. `HostSyncGuard` sees every
op a step dispatches, on any device (so a test on the CPU checks the GPU path's code), counts them, counts
the host syncs among them, and with `strict` raises at the first one, naming it.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose result reaches the host, or whose output shape depends on tensor values
SYNC_OPS = {
    "aten::_local_scalar_dense",  # .item(), int(t), bool(t), float(t)
    "aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::unique_dim", "aten::_unique2",
    "aten::unique_consecutive", "aten::bincount", "aten::histc", "aten::equal", "aten::is_nonzero",
    "aten::_assert_async",
}


class HostSyncError(RuntimeError):
    pass


def _triton_launchers() -> list[type]:
    """Triton's kernel classes whose `run` launches a kernel (compiled, and interpreted), where installed."""
    if importlib.util.find_spec("triton") is None:
        return []
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return [JITFunction, InterpretedFunction]


def _is_sync(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in SYNC_OPS:
        return True
    if name == "aten::repeat_interleave":  # without output_size it reads the repeats' sum on the host
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name == "aten::index" or name == "aten::index_put_" or name == "aten::index_put":
        return any(t is not None and t.dtype == torch.bool for t in args[1])  # boolean mask indexing
    return False


class HostSyncGuard(TorchDispatchMode):
    """Counts the ops dispatched inside it (`ops`, `counts` by name) and the host syncs (`syncs`, by name in
    `sync_counts`); `strict` raises HostSyncError at the first sync. `.tolist()` and `.numpy()` read a tensor
    without dispatching an op: inside the guard they count (and raise) too. A Triton kernel launch counts as
    one op, `triton::<kernel>`, whether compiled or interpreted; the torch ops Triton's interpreter runs to
    emulate a kernel on CPU tensors are not counted (a GPU runs none of them)."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict = strict
        self.counts: Counter[str] = Counter()
        self.sync_counts: Counter[str] = Counter()
        self._in_kernel = False

    @property
    def ops(self) -> int:
        return sum(self.counts.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_counts.values())

    def _sync(self, name: str) -> None:
        self.sync_counts[name] += 1
        if self.strict:
            raise HostSyncError(f"host sync in a step that must have none: {name}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_kernel:
            return func(*args, **kwargs)
        name = func._schema.name
        self.counts[name] += 1
        if _is_sync(func, args, kwargs):
            self._sync(name)
        return func(*args, **kwargs)

    def __enter__(self):
        self._patched = []
        for attr in ("tolist", "numpy"):
            original = getattr(torch.Tensor, attr)

            def reading(t, *a, _attr=attr, _original=original, **k):
                if not self._in_kernel:
                    self._sync(f"Tensor.{_attr}")
                return _original(t, *a, **k)
            self._patch(torch.Tensor, attr, reading)
        for cls in _triton_launchers():
            def launch(fn, *a, _original=cls.run, **k):
                if self._in_kernel:
                    return _original(fn, *a, **k)
                self.counts[f"triton::{getattr(fn, '__name__', 'kernel')}"] += 1
                self._in_kernel = True
                try:
                    return _original(fn, *a, **k)
                finally:
                    self._in_kernel = False
            self._patch(cls, "run", launch)
        return super().__enter__()

    def _patch(self, owner, attr: str, replacement) -> None:
        self._patched.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, replacement)

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        return super().__exit__(*exc)

    def summary(self, top: int = 8) -> str:
        common = ", ".join(f"{n.removeprefix('aten::')} {c}" for n, c in self.counts.most_common(top))
        return f"{self.ops} ops, {self.syncs} host syncs ({dict(self.sync_counts) or 'none'}); most: {common}"
