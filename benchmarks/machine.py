"""The first lines every benchmark prints: what machine and dtype its numbers belong to.

CPUs differ by ~100x in bf16 matmul speed (native AVX512-BF16/AMX vs emulated on AVX2), so a number
without the CPU capability, the dtype and that dtype's measured peak cannot be read."""

from __future__ import annotations

import platform

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


def machine_header(dtype_name: str = "auto", probe_peak: bool = True) -> tuple[torch.dtype, float]:
    """Print the machine lines; return (the resolved dtype, its measured matmul peak in FLOP/s)."""
    dtype, why = resolve_dtype(dtype_name)
    print(f"machine: {platform.machine()}, CPU capability {torch.backends.cpu.get_cpu_capability()} "
          f"(native bf16 matmul: {'yes' if cpu_has_native_bf16() else 'no'}), {torch.get_num_threads()} torch "
          f"threads, torch {torch.__version__}")
    if not probe_peak:
        print(f"dtype: {why}")
        return dtype, float("nan")
    peak = measure_peak_flops(dtype, seconds=1.0)
    print(f"dtype: {why}; measured {str(dtype).removeprefix('torch.')} matmul peak (1024³): {peak / 1e9:.0f} GFLOP/s")
    return dtype, peak
