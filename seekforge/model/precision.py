"""Which compute dtype this machine runs fast.

bf16 halves the bytes of every weight and activation, but only hardware with native bf16 matmuls turns
that into speed: GPUs, and CPUs with AVX512-BF16 or AMX. A CPU with AVX2 only emulates it, about a hundred
times slower than its fp32, so `auto` means bf16 on those devices and fp32 everywhere else. Flags are not the
whole story: one AVX512-BF16 machine measured its bf16 matmuls well ahead of fp32 one morning and behind it that
evening, when the default pretrain's step ran faster in fp32. So on a CPU with the flags, `auto` also times one
1024³ matmul in each dtype (once per process, a fraction of a second) and keeps bf16 only where it measured at
least BF16_MIN_SPEEDUP times fp32's speed;
near that ratio the pick can differ between runs — give bf16 or fp32 for a fixed one. Under torchrun
(WORLD_SIZE > 1) the flags alone decide, so that every rank picks the same dtype. Nor does a fast 1024³
probe speak for a narrow model's small matmuls: given the model's width, `auto` keeps fp32 on a CPU below
CPU_MIN_BF16_HIDDEN.

SEEKFORGE_CPU_BF16=0 (or 1) overrides the CPU detection, e.g. to try the fp32 path on a bf16 machine.
torch's own ATEN_CPU_CAPABILITY=avx2 also counts as a CPU without native bf16.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cpu_has_native_bf16() -> bool:
    forced = os.environ.get("SEEKFORGE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "NO AVX"):
        return False  # torch was asked (or can) only use AVX2 kernels
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def auto_dtype_help() -> str:
    """What `auto` means, for --help texts and messages (resolve_dtype is the rule itself)."""
    return ("bf16 on GPUs, and on CPUs whose native bf16 matmuls (AVX512-BF16/AMX) measure faster than fp32's "
            f"for a model at least {CPU_MIN_BF16_HIDDEN} wide; fp32 elsewhere")


# bf16 must measure at least this many times fp32's matmul speed for `auto` to pick it on a CPU
BF16_MIN_SPEEDUP = 1.2


@functools.cache
def cpu_bf16_speedup(n: int = 1024, repeats: int = 3) -> float:
    """bf16 ÷ fp32 throughput of an n³ matmul on this CPU, best of `repeats` each (measured once)."""
    def best_seconds(dtype: torch.dtype) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up: packing buffers, kernel selection
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    return best_seconds(torch.float32) / best_seconds(torch.bfloat16)


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 on GPUs and on CPUs whose native bf16 matmuls measure faster than fp32 here, else fp32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    if not cpu_has_native_bf16():
        return torch.float32
    if os.environ.get("SEEKFORGE_CPU_BF16") == "1" or _ranks() > 1:
        return torch.bfloat16  # the ranks of one job must agree, and their timings could differ: the flags decide
    return torch.bfloat16 if cpu_bf16_speedup() >= BF16_MIN_SPEEDUP else torch.float32


def _ranks() -> int:
    """The job's world size as torchrun announces it (known before any process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# Below this width `auto` keeps fp32 on a CPU even when its bf16 matmuls are fast: the matmuls are too small
# for the bf16 kernels to outrun fp32 (oneDNN, which runs them, also has a higher fixed cost a call than MKL's
# fp32 at one row), and the casts around them remain. The default pretrain (hidden 192) was a little faster in
# bf16 on an AMX CPU but ended at a worse loss with more memory, and served no faster in bf16 on an AVX512-BF16
# CPU without AMX. From 512 wide bf16 pays for training, GRPO's rollouts and serving alike, on both kinds of
# CPU (the `small` preset: train_step.py, serve_throughput.py, serve_peers.py; BENCHMARKS.md and, for the
# bf16/fp32 A/B runs that set this width, its history: git log -p BENCHMARKS.md).
CPU_MIN_BF16_HIDDEN = 512


def resolve_dtype(name: str, device: str | torch.device = "cpu",
                  hidden_size: int | None = None) -> tuple[torch.dtype, str]:
    """'auto' | 'bf16' | 'fp32' (also 'bfloat16' / 'float32') → (dtype, a line saying why). hidden_size:
    the model's width, when known — on a CPU, `auto` keeps fp32 below CPU_MIN_BF16_HIDDEN."""
    name = {"bfloat16": "bf16", "float32": "fp32"}.get(name, name)
    if name in DTYPES:
        return DTYPES[name], f"{name} (asked for)"
    if name != "auto":
        raise ValueError(f"dtype {name!r} is not one of auto, bf16, fp32")
    if torch.device(device).type == "cpu" and hidden_size is not None and hidden_size < CPU_MIN_BF16_HIDDEN:
        return torch.float32, (f"fp32 (auto: hidden_size {hidden_size} < {CPU_MIN_BF16_HIDDEN}: on a CPU, bf16 pays "
                               f"from {CPU_MIN_BF16_HIDDEN} wide; --dtype bf16 to force)")
    dtype = auto_dtype(device)
    if torch.device(device).type == "cuda":
        why = "GPU"
    elif os.environ.get("SEEKFORGE_CPU_BF16") in ("0", "1"):
        why = f"SEEKFORGE_CPU_BF16={os.environ['SEEKFORGE_CPU_BF16']}"
    elif cpu_has_native_bf16() and _ranks() > 1:
        why = f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul; not timed under torchrun"
    elif cpu_has_native_bf16():
        verdict = "" if dtype == torch.bfloat16 else f", below the {BF16_MIN_SPEEDUP}x that bf16 needs"
        why = (f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul measured at "
               f"{cpu_bf16_speedup():.2f}x fp32's speed{verdict}")
    else:
        why = (f"CPU capability {torch.backends.cpu.get_cpu_capability()}, no native bf16 matmul "
               "(emulated: ~100x slower)")
    return dtype, f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} (auto: {why})"


# oneDNN, which runs a CPU's bf16 and fp16 matmuls, builds (JIT-compiles) a kernel for each new shape and
# caches it: an mm whose row count it has not seen costs an order of magnitude more than one it has, and each
# cached kernel holds about a megabyte. Work whose sizes change every step (expert row counts,
# packed rows, a growing decode context) rounds them up with `onednn_size` so that the shapes repeat.
# fp32 runs on MKL, which builds nothing per shape.
#
# oneDNN keeps the last 1,024 kernels by default. A GRPO iteration in bf16 needs more (rollout shapes, then
# training shapes), so each phase evicted the other's kernels and rebuilt hundreds of them every iteration,
# which made a `small` iteration markedly slower than with room for 4,096, at the same peak RSS (an evicted
# kernel's memory did not go back to the system anyway). So seekforge asks for
# 4,096. oneDNN reads the variable when it builds its first kernel, so this holds unless something
# built one before seekforge was imported; a value set by the user wins.
ONEDNN_CACHE_CAPACITY = 4096
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


def uses_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """Do matmuls of `dtype` on `device` run on oneDNN (and so build a kernel per shape)?"""
    return torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def matmul_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a matmul with `weight` computes in here: autocast's where it is on, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def onednn_size(n: int) -> int:
    """n itself up to 64 (64 sizes, all soon cached); above, n rounded up to a multiple of 1/8 of the power
    of two below it: 8 sizes per doubling, at most 12.5% padding (~3% on average)."""
    if n <= 64:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


@contextlib.contextmanager
def onednn(enabled: bool):
    """CPU matmuls inside run on oneDNN (torch's default for bf16) or, when `enabled` is False, on torch's
    own kernels; the switch is process-wide, restored on the way out.

    For a one-row bf16 matmul oneDNN's fixed cost per call is about twice torch's own bf16 gemv (measured
    on an AMX CPU), and batch-1 decoding runs ~100 of them per token. Products that read a matrix across its
    rows, as attention's probs @ latents does, go the other way: torch's own kernels ran them several times
    slower, so attention stays on oneDNN."""
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(enabled)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)
