"""CPU kernels of our own, compiled on first use: decode attention over MLA latents (csrc/latent_attention.cpp).

At decode, each sequence's heads are the query rows of one attention over its latents [c_kv | k_pe]
(MLA._attend_latents). PyTorch's flash kernel runs that as two small GEMM calls per sequence, and at M = 8
rows (the `small` preset's heads) their per-call costs dominate: 64 sequences × 192 latents × 576 took
4.2-4.5 ms a layer in bf16 and 4.1-5.7 ms in fp32 on an AVX512-BF16 CPU without AMX (AMD EPYC, 2 threads),
against 2.4-2.8 and 3.4-4.1 ms for this kernel, which reads each latent row once for both passes. On CPUs
with AMX the flash kernel's bf16 GEMMs run on AMX tiles (~1.2 ms a layer on the AMX machine BENCHMARKS.md
was measured on) and this kernel, which has no AMX path, is not used there.

The kernel is built with torch.utils.cpp_extension (a C++ compiler and ninja, the same toolchain
torch.compile needs on a CPU) into torch's extension cache, once per machine (~15-40 s); a process then loads
it in milliseconds. Where it cannot be built, or SEEKFORGE_CPU_KERNELS=0, attention keeps PyTorch's kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "latent_attention.cpp"
_loaded: bool | None = None  # None: not tried yet


def cpu_kernels_wanted() -> bool:
    """Does this CPU run our kernels better than PyTorch's: AVX-512 without AMX (see the module docstring)."""
    if os.environ.get("SEEKFORGE_CPU_KERNELS") == "0":
        return False
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and not torch.cpu._is_amx_tile_supported()


def load_latent_attention() -> bool:
    """Build (once per machine) and load the latent-attention kernel when this CPU wants it; True when
    torch.ops.seekforge.latent_attention is ready. Call it before tracing (the engine does, when it builds
    its caches): a build inside torch.compile's tracing would stall it."""
    global _loaded
    if _loaded is None:
        _loaded = cpu_kernels_wanted() and build()
    return _loaded


def latent_attention_ready() -> bool:
    """Loaded already (no build attempted here): what the attention's hot path asks."""
    return bool(_loaded)


def kernel_takes(latents: torch.Tensor) -> bool:
    """The kernel's inputs: CPU fp32/bf16 latents with contiguous rows."""
    return latents.device.type == "cpu" and latents.dtype in (torch.float32, torch.bfloat16) and latents.stride(-1) == 1


@functools.cache
def build() -> bool:
    """Compile (or find in torch's extension cache) and load the kernel on any AVX-512 CPU, and register its
    shape function for torch.compile; True when torch.ops.seekforge.latent_attention exists."""
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None or not cpp_extension.is_ninja_available():
        log.warning("no C++ compiler or ninja: decode attention keeps PyTorch's kernel (slower on this CPU)")
        return False
    # -fopenmp: at::parallel_for splits the sequences over torch's OpenMP threads only when compiled with it
    flags = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    # the name carries a hash of source and flags: an edited kernel is rebuilt, never an old build loaded
    digest = hashlib.sha256((SOURCE.read_text() + " ".join(flags)).encode()).hexdigest()[:12]
    name = f"seekforge_latent_attention_{digest}"
    log.info("loading the CPU decode-attention kernel %s (the first use on a machine compiles it, ~15-40 s)", name)
    try:
        cpp_extension.load(name, [str(SOURCE)], extra_cflags=flags, is_python_module=False, verbose=False)
    except Exception as e:  # a broken toolchain must not stop serving: the fallback is correct, only slower
        log.warning("the CPU decode-attention kernel did not build (%s): keeping PyTorch's kernel", e)
        return False

    @torch.library.register_fake("seekforge::latent_attention")
    def _(q, latents, lengths, scale, value_dim):
        return q.new_empty(q.shape[0], q.shape[1], value_dim)

    return True
