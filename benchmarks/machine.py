"""The first lines every benchmark prints: what machine and dtype its numbers belong to, and how busy it was.

CPUs differ by ~100x in bf16 matmul speed (native AVX512-BF16/AMX vs emulated on AVX2), so a number
without the CPU capability, the dtype and that dtype's measured peak cannot be read. Other processes on the
cores slow a multi-threaded step by far more than their share (benchmarks/serve_load.py), hence the load average."""

from __future__ import annotations

import os
import platform
import time

import torch

from seekforge.model.precision import cpu_has_native_bf16, resolve_dtype
from seekforge.train.flops import measure_peak_flops


def dtype_arg(parser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                        help="compute dtype for every system measured; auto: bf16 where the hardware runs it "
                             "natively (GPU, AVX512-BF16/AMX), else fp32")


def parse_args(parser, threads: int | None = None):
    """Add --threads (default: `threads`, else torch's) and --dtype, parse, and apply --threads."""
    parser.add_argument("--threads", type=int, default=threads or torch.get_num_threads())
    dtype_arg(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def machine_header(dtype_name: str = "auto", probe_peak: bool = True,
                   hidden_size: int | None = None) -> tuple[torch.dtype, float]:
    """Print the machine lines; return (the resolved dtype, its measured matmul peak in FLOP/s). hidden_size:
    the benchmarked model's width, which `auto` weighs as the product does
    (model/precision.resolve_dtype)."""
    dtype, why = resolve_dtype(dtype_name, hidden_size=hidden_size)
    print(f"machine: {platform.machine()}, CPU capability {torch.backends.cpu.get_cpu_capability()} "
          f"(native bf16 matmul: {'yes' if cpu_has_native_bf16() else 'no'}), {torch.get_num_threads()} torch "
          f"threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if not probe_peak:
        print(f"dtype: {why}")
        return dtype, float("nan")
    peak = measure_peak_flops(dtype, seconds=1.0)
    print(f"dtype: {why}; measured {str(dtype).removeprefix('torch.')} matmul peak (1024³): {peak / 1e9:.0f} GFLOP/s")
    return dtype, peak


def weight_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """Bytes of weights one decoded token reads: every active parameter (the K routed experts of each
    MoE layer, not all E) but one embedding row instead of the table; routers stay fp32."""
    active = cfg.num_params()["active"] - cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    routers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) * cfg.n_routed_experts * cfg.hidden_size
    size = torch.tensor([], dtype=dtype).element_size()
    return active * size + routers * (4 - size)


def measure_stream_bandwidth(nbytes: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Bytes/s that a one-row linear layer (a (1, 1024) input: the call batch-1 decode makes with each weight)
    streams through a (·, 1024) weight of `nbytes` in `dtype`: the fastest of F.linear and seekforge's own
    few-row kernel where this CPU runs it (model/kernels.py), each on 4 KiB pages and then on 2 MiB ones where
    the system moves the weight there (the engine's weights are, model/pages.py), so the bound is what this
    machine can stream, not what one library does. Sized like the model, so the weight sits in the same level
    of the memory hierarchy as the model's (one that fits the last-level cache streams from there)."""
    from seekforge.model import kernels, pages

    gen = torch.Generator().manual_seed(0)
    rows = max(1, nbytes // (1024 * torch.tensor([], dtype=dtype).element_size()))
    w = torch.randn(rows, 1024, generator=gen).to(dtype)
    x = torch.randn(1, 1024, generator=gen).to(dtype)
    calls = [torch.nn.functional.linear] + ([kernels.linear] if kernels.load() else [])
    best = 0.0
    with torch.no_grad():
        for huge in (False, True):
            if huge and not pages.collapse([w])[0]:
                break
            for linear in calls:
                for _ in range(2):
                    linear(x, w)
                iters, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    linear(x, w)
                    iters += 1
                best = max(best, w.nbytes * iters / (time.perf_counter() - start))
    return best
