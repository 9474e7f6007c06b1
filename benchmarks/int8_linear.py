"""Where a W8A8-dynamic linear's batch-1 time goes, next to the bf16 / fp32 nn.Linear it replaces.

    OMP_NUM_THREADS=1 python benchmarks/int8_linear.py

One token (M = 1) through one linear of each shape: the default run's (192 → 576, 96 → 192, …) and
wider ones where the weight no longer fits the caches (1024 → 4096 and up). Rows: bf16 and fp32
`F.linear`; our W8A8 path (seekforge.quant.kernels.int8_matmul) and its three parts — the per-token
activation quantization, `torch._int_mm`, the rescale to the activation dtype; and torch's
weight-only int8 kernel (`_weight_int8pack_mm`, W8A16) for scale. Microseconds of the thread's CPU
time per call (`time.thread_time`: the work, not the waits for a core on a shared machine), median
of interleaved rounds, the load average printed with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from machine import machine_header, parse_args  # benchmarks/machine.py

from seekforge.quant.kernels import int8_matmul
from seekforge.quant.schemes import quantize_activation

SHAPES = [(192, 576), (96, 192), (64, 256), (1024, 4096), (4096, 1024), (2048, 8192)]  # (in, out)


def cpu_us(fn, n: int) -> float:
    fn()
    t = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t) / n * 1e6


def cases(i: int, o: int) -> dict:
    x = torch.randn(1, i, dtype=torch.bfloat16)
    w = torch.randn(o, i, dtype=torch.bfloat16)
    xf, wf = x.float(), w.float()
    q = torch.randint(-127, 128, (o, i), dtype=torch.int8)
    qt, scale = q.t().contiguous(), torch.rand(o)
    xq, x_scale = quantize_activation(x)
    acc = torch._int_mm(xq, qt)
    return {"bf16 linear": lambda: F.linear(x, w), "fp32 linear": lambda: F.linear(xf, wf),
            "w8a8 (ours)": lambda: int8_matmul(x, qt, scale, None),
            "  quantize x": lambda: quantize_activation(x), "  _int_mm": lambda: torch._int_mm(xq, qt),
            "  rescale": lambda: torch.mul(acc, x_scale * scale).to(torch.bfloat16),
            "w8a16 int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale.bfloat16())}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = parse_args(p, threads=1)
    machine_header("bf16", probe_peak=False)
    names = list(cases(8, 8))
    print(f"{'in → out':<12}" + "".join(f"{n.strip():>15}" for n in names) + "   (µs CPU per call, M = 1)")
    for i, o in SHAPES:
        fns, n = cases(i, o), 1000 if i * o < 1e6 else 40
        times = {name: [] for name in fns}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(cpu_us(fns[name], n))
        print(f"{f'{i} → {o}':<12}" + "".join(f"{statistics.median(times[k]):15.1f}" for k in names)
              + f"   load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
