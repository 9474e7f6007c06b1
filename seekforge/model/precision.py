"""Which compute dtype this machine runs fast.

bf16 halves the bytes of every weight and activation, but only hardware with native bf16 matmuls turns
that into speed: GPUs, and CPUs with AVX512-BF16 or AMX. A CPU with AVX2 only emulates it — a bf16
1024³ matmul ran at 0.6 GFLOP/s there against 69 GFLOP/s in fp32 — so `auto` means bf16 on those
devices and fp32 everywhere else.

SEEKFORGE_CPU_BF16=0 (or 1) overrides the CPU detection, e.g. to try the fp32 path on a bf16 machine.
torch's own ATEN_CPU_CAPABILITY=avx2 also counts as a CPU without native bf16.
"""

from __future__ import annotations

import os

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cpu_has_native_bf16() -> bool:
    forced = os.environ.get("SEEKFORGE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "NO AVX"):
        return False  # torch was asked (or can) only use AVX2 kernels
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 where the device runs bf16 matmuls natively, else fp32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """'auto' | 'bf16' | 'fp32' (also 'bfloat16' / 'float32') → (dtype, a line saying why)."""
    name = {"bfloat16": "bf16", "float32": "fp32"}.get(name, name)
    if name in DTYPES:
        return DTYPES[name], f"{name} (asked for)"
    if name != "auto":
        raise ValueError(f"dtype {name!r} is not one of auto, bf16, fp32")
    dtype = auto_dtype(device)
    if torch.device(device).type == "cuda":
        why = "GPU"
    elif os.environ.get("SEEKFORGE_CPU_BF16") in ("0", "1"):
        why = f"SEEKFORGE_CPU_BF16={os.environ['SEEKFORGE_CPU_BF16']}"
    else:
        native = "native bf16 matmul" if dtype == torch.bfloat16 else "no native bf16 matmul (emulated: ~100x slower)"
        why = f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {native}"
    return dtype, f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} (auto: {why})"
