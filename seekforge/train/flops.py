"""A measured matmul peak and model FLOPs utilization. The model's FLOPs per token (PaLM appendix B
convention) are config/sizes.py's `flops_per_token`, re-exported here for MFU's callers."""

from __future__ import annotations

import time

import torch

from seekforge.config.sizes import flops_per_token

__all__ = ["flops_per_token", "measure_peak_flops", "model_flops_utilization"]


def measure_peak_flops(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                       size: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of a square matmul in `dtype`: the achievable peak of this machine, right now.
    On shared CPUs it moves with the load; pass TrainConfig.peak_flops to fix it."""
    # A private generator: probing must not shift the global RNG stream that training (and its exact
    # resume) depends on.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device).to(dtype)
    for _ in range(2):  # warm up caches and the BLAS thread pool
        a @ b
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
        if iters % 4 == 0:
            sync()
    sync()
    return 2 * size**3 * iters / (time.perf_counter() - start)


def model_flops_utilization(flops_per_s: float, peak_flops: float) -> float:
    """Achieved / peak, at most 1: a rate above the probe's peak means the probe ran slow (a loaded
    machine, a cold thread pool), and the true peak is at least what was achieved."""
    return flops_per_s / max(peak_flops, flops_per_s)
