"""How many CPU threads torch runs on, and how its idle threads wait: graceful on a busy machine.

A decode step is hundreds of short parallel regions (each matmul, each fused kernel of a compiled step), and each
region ends in a barrier where the threads wait for the slowest. torch's CPU wheel runs them on OpenMP (libgomp:
`torch.__config__.parallel_info()`), whose idle threads spin for a while before they sleep, so that the next region
finds them awake. On a quiet machine that spinning is free. When other processes keep the cores busy it is not:
the spinning threads stay runnable, take their share of the cores from the thread doing the work, and every barrier
waits for a thread that the scheduler has put off for a time slice. On a shared 2-core machine two threads then
decoded many times slower than one (benchmarks/serve_load.py, BENCHMARKS.md).

Sleeping has its price: waking a sleeping thread costs far more than a spin (on a virtual machine's idle vCPU most
of all), and a decode step wakes them hundreds of times: on a quiet 2-core VM, two sleeping-at-barriers threads
decoded several times slower than two spinning ones, slower even than one thread (BENCHMARKS.md, serve_load.py).
So `configure_openmp` decides at start, from a short look at what other processes do with the cores: when they keep
at least BUSY_CORES of them busy, OMP_WAIT_POLICY=PASSIVE (an idle thread sleeps at once, holds no core while it
waits, and is the one the scheduler runs first when it wakes, ahead of the busy processes); on a quiet machine the
runtime's spinning default stays. A shorter spin (GOMP_SPINCOUNT=10000) kept most of the collapse. One thread,
which has no barrier at all, was as often slower as faster than two sleeping ones beside the same load, and more
threads pay on a larger machine, so `default_threads` does not drop threads on a busy one: it counts the cores this
process may use (its CPU affinity, and a cgroup's CPU quota, which OpenMP's own default ignores). Both are fixed at
start: the runtime reads its policy once, and a compiled step's kernels are generated for one thread count. A
machine that gets busy after a server started keeps the quiet choice (OMP_WAIT_POLICY=PASSIVE sets it for good).

OpenMP reads its settings once, when it is loaded, i.e. at `import torch`: configure_openmp must run before torch is
imported (seekforge's CLI calls it first), and this module imports no torch. OMP_NUM_THREADS, OMP_WAIT_POLICY or
GOMP_SPINCOUNT set by the user win (OMP_WAIT_POLICY=ACTIVE: spin, for a machine that runs nothing else).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Other processes keeping this many cores' worth busy make the machine "busy": half a core already stalls barriers
# often enough (a thread then shares its core half the time).
BUSY_CORES = 0.5
PROBE_SECONDS = 0.2  # a few scheduler ticks: long enough to see a busy loop on every core, short at start-up


def configure_openmp(environ=os.environ, busy: float | None = None) -> str:
    """Make idle OpenMP threads sleep at once instead of spinning when other processes keep the cores busy (module
    docstring), unless the user set a wait policy. Returns what is in effect, for a log line. Only effective before
    torch is imported. busy: other processes' busy cores, given in tests, probed otherwise."""
    chosen = {k: environ[k] for k in WAIT_POLICY_VARIABLES if k in environ}
    if chosen:
        return "OpenMP wait policy as set: " + ", ".join(f"{k}={v}" for k, v in chosen.items())
    if "torch" in sys.modules:
        return "OpenMP wait policy: the runtime's default (torch was imported before seekforge could set it)"
    if environ.get("OMP_NUM_THREADS") == "1":  # torchrun's ranks, say
        return "OpenMP wait policy: the runtime's default (one thread: no barrier to wait at)"
    if busy is None:
        busy = others_busy_cores()
    if busy < BUSY_CORES:
        return f"OpenMP wait policy: the runtime's default (spin; other processes keep {busy:.1f} cores busy)"
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return (f"OpenMP wait policy: PASSIVE (other processes keep {busy:.1f} cores busy: idle threads sleep, so they "
            "do not stall each other's barriers; OMP_WAIT_POLICY=ACTIVE to spin)")


def others_busy_cores(seconds: float = PROBE_SECONDS) -> float:
    """How many cores' worth other processes keep busy, from /proc/stat over `seconds` while this process sleeps
    (0 where there is no /proc/stat: macOS, Windows)."""
    if not Path("/proc/stat").exists():
        return 0.0
    cores = affine_cores()
    before = read_cpu_times()
    time.sleep(seconds)
    return busy_cores(before, read_cpu_times(), cores)


def affine_cores() -> set[int]:
    """The core ids this process may run on (every core where the system cannot say: macOS has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def read_cpu_times(stat: str | None = None) -> dict[int, tuple[int, int]]:
    """/proc/stat's per-core (busy, total) jiffies. Idle and iowait are the idle kinds; steal counts as busy (a
    hypervisor's other guests have the core)."""
    stat = Path("/proc/stat").read_text() if stat is None else stat
    times = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle = values[3] + values[4]
            times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times


def busy_cores(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cores: set[int]) -> float:
    """How many of `cores` were busy between two read_cpu_times samples, in cores: 1.5 = one core fully and another
    half busy."""
    busy = 0.0
    for core in cores & before.keys() & after.keys():
        total = after[core][1] - before[core][1]
        if total > 0:
            busy += (after[core][0] - before[core][0]) / total
    return busy


def usable_cores(affinity: set[int] | None = None, cpu_max: str | None = None) -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), capped by a cgroup v2
    CPU quota (`docker --cpus 1.5` → 1). affinity, cpu_max: given in tests, read from the system otherwise."""
    if affinity is None:
        affinity = affine_cores()
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
