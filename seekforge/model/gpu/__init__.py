"""The GPU path: which code a step runs on a CUDA device, and its Triton kernels.

Most of the model has one code path for every device. Where the CPU and the GPU want different code (the
CPU's per-expert loop of mms vs one grouped GEMM with offsets on the device; cache-sized loss chunks vs a few
large ones; eager decode vs CUDA graphs over Triton kernels) the model asks `gpu_path(device)`. It is True
on CUDA, and on a CPU inside `forced_gpu_path()`: tests run the GPU's code on CPU tensors there, with the
Triton kernels in Triton's interpreter (TRITON_INTERPRET=1), under `sync.HostSyncGuard`, which fails on any
host sync. Nothing here needs a GPU or Triton to import: `triton_ready` says whether the kernels can run.

Kernels (one module each, each with its torch reference beside it and an interpreter test in tests/model/gpu):
  cross_entropy.py  fused linear + cross-entropy for training (the logits never materialize in full)
  mla_decode.py     absorbed-MLA decode attention over the paged latent cache, split over the context
  fused_moe.py      the routed experts of a decode-sized batch in two kernels (tokens × chosen experts),
                    the kernels in fused_moe_kernels.py (imported where Triton runs)

Triton's interpreter (3.9) computes on bf16 values as their bit patterns (a bf16 add, mul or tl.dot is
wrong there; loads, stores and `.to(tl.float32)` are right): a kernel takes `UPCAST: tl.constexpr`
= `interpreting()` and converts its bf16 operands to fp32 before any arithmetic when it is set. On a GPU
the dots stay in bf16 with fp32 accumulation.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

_forced = False


def gpu_path(device: torch.device | torch.Tensor) -> bool:
    """Whether code on `device` (or a tensor's) takes the GPU path: on CUDA, or anywhere inside
    `forced_gpu_path`."""
    if isinstance(device, torch.Tensor):
        device = device.device
    return device.type == "cuda" or _forced


@contextlib.contextmanager
def forced_gpu_path():
    """Run the GPU path on whatever device the tensors are on (tests: CPU tensors, Triton interpreted)."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


def interpreting() -> bool:
    """Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, read when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_ready(device: torch.device | torch.Tensor) -> bool:
    """Whether our Triton kernels can run on `device`: Triton installed, and the device a CUDA GPU or the
    kernels interpreted (then on CPU tensors)."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if not triton_installed():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())
