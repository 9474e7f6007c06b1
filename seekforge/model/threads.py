"""How many CPU threads torch runs on, and how its idle threads wait: graceful on a busy machine.

A decode step is hundreds of short parallel regions (each matmul, each fused kernel of a compiled step), and each
region ends in a barrier where the threads wait for the slowest. torch's CPU wheel runs them on OpenMP (libgomp:
`torch.__config__.parallel_info()`), whose idle threads spin for a while before they sleep, so that the next region
finds them awake. On a quiet machine that spinning is free. When other processes keep the cores busy it is not:
the spinning threads stay runnable, take their share of the cores from the thread doing the work, and every barrier
waits for a thread that the scheduler has put off for a time slice. On a shared 2-core machine two threads then
decoded 50-100x slower than one (benchmarks/serve_load.py, BENCHMARKS.md).

`configure_openmp` sets OMP_WAIT_POLICY=PASSIVE: an idle thread sleeps at once. It then holds no core while it
waits, and a thread that mostly sleeps is the one the scheduler runs first when it wakes, ahead of the busy
processes. A shorter spin (GOMP_SPINCOUNT=10000) kept most of the collapse. One thread, which has no barrier at all,
was as often slower as faster than two sleeping ones beside the same load on 2 cores, and more threads pay on a
larger machine, so `default_threads` does not drop threads on a busy one: it counts the cores this process may use
(its CPU affinity, and a cgroup's CPU quota, which OpenMP's own default ignores). The count is fixed at start: a
compiled step's kernels are generated for one thread count.

OpenMP reads its settings once, when it is loaded, i.e. at `import torch`: configure_openmp must run before torch is
imported (seekforge's CLI calls it first), and this module imports no torch. OMP_NUM_THREADS, OMP_WAIT_POLICY or
GOMP_SPINCOUNT set by the user win (OMP_WAIT_POLICY=ACTIVE: spin, for a machine that runs nothing else).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def configure_openmp(environ=os.environ) -> str:
    """Make idle OpenMP threads sleep at once instead of spinning (module docstring), unless the user set a wait
    policy. Returns what is in effect, for a log line. Only effective before torch is imported."""
    chosen = {k: environ[k] for k in WAIT_POLICY_VARIABLES if k in environ}
    if chosen:
        return "OpenMP wait policy as set: " + ", ".join(f"{k}={v}" for k, v in chosen.items())
    if "torch" in sys.modules:
        return "OpenMP wait policy: the runtime's default (torch was imported before seekforge could set it)"
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "OpenMP wait policy: PASSIVE (idle threads sleep: other processes on the cores do not stall their barriers)"


def usable_cores(affinity: set[int] | None = None, cpu_max: str | None = None) -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), capped by a cgroup v2
    CPU quota (`docker --cpus 1.5` → 1). affinity, cpu_max: given in tests, read from the system otherwise."""
    if affinity is None:  # macOS has no affinity: every core
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if cpu_max is None:
        path = Path("/sys/fs/cgroup/cpu.max")
        cpu_max = path.read_text() if path.exists() else "max"
    quota, period = (cpu_max.split() + ["100000"])[:2]  # "max 100000", or "150000 100000" for 1.5 cores
    cores = len(affinity)
    if quota != "max":
        cores = min(cores, int(quota) // int(period))
    return max(1, cores)


def default_threads(environ=os.environ) -> tuple[int, str]:
    """(torch threads, why) when the user gave none: OMP_NUM_THREADS where set (torchrun sets 1 per rank), else
    the usable cores, busy or not (module docstring)."""
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cores = usable_cores()
    return cores, f"the {cores} cores this process may use (CPU affinity, cgroup quota)"
