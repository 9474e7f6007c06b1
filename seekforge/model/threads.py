"""How many CPU threads torch runs on, and how its idle threads wait: graceful on a busy machine.

A decode step is hundreds of short parallel regions (each matmul, each fused kernel of a compiled step), and every
region ends in a barrier where all threads wait for the slowest. On a quiet machine that costs microseconds. When
other processes keep the cores busy, the scheduler takes one of our threads off its core for a time slice
(milliseconds) now and then, and every barrier it misses stalls the others; meanwhile the waiting threads spin and
burn the very core time the late thread needs. With two busy-loop processes on two cores, batch-1 decode on two
threads took 7-16x its quiet time, where one thread, which has no barrier, lost only its share of the cores
(benchmarks/serve_load.py; BENCHMARKS.md). So, unless the user chose:

1. Threads = the cores this process may use (its CPU affinity, a cgroup's CPU quota) less the cores other processes
   keep busy right now, at least one (`default_threads`). "Right now" is a short /proc/stat sample, not the load
   average: that is a minute-long average, which lags a load that just started and remembers one that ended.
   The choice is made once, at start: a compiled step's kernels are generated for a fixed thread count.
2. Idle OpenMP threads sleep instead of spinning (`configure_openmp`: OMP_WAIT_POLICY=PASSIVE), so a thread
   waiting at a barrier gives its core back to the one it waits for. torch's CPU wheel runs ATen's parallelism on
   OpenMP (libgomp: `torch.__config__.parallel_info()`), whose runtime reads its settings once, when it is loaded,
   i.e. at `import torch`; so this must run before torch is imported (seekforge's CLI does it first thing).

This module imports no torch, for that reason. OMP_NUM_THREADS, OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user
win over both choices.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

# A core counts as taken by others when they kept it busy at least this much of the probe: a thread sharing a
# core half-busy with another process misses barriers often enough to cost more than it adds.
BUSY_CORE_SHARE = 0.5
PROBE_SECONDS = 0.25  # long enough to see a busy loop on every core (a few scheduler ticks), short at start-up
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
    return "OpenMP wait policy: PASSIVE (idle threads sleep: a busy machine does not stall their barriers)"


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
    """How many of `cores` others kept busy between two read_cpu_times samples (taken while this process slept),
    in cores: 1.5 = one core fully and another half busy."""
    busy = 0.0
    for core in cores & before.keys() & after.keys():
        total = after[core][1] - before[core][1]
        if total > 0:
            busy += (after[core][0] - before[core][0]) / total
    return busy


def choose_threads(usable: int, cores: int, busy: float) -> int:
    """Threads for a process that may use `usable` threads' worth of `cores` cores (usable_cores; fewer under a
    quota), of which other processes keep `busy` cores' worth busy: one per core they leave free, a core counting
    as taken from BUSY_CORE_SHARE busy on; at least one."""
    taken = math.floor(busy + 1 - BUSY_CORE_SHARE)
    return max(1, min(usable, cores - taken))


def default_threads(environ=os.environ) -> tuple[int, str]:
    """(torch threads, why) when the user chose none: OMP_NUM_THREADS if set, else choose_threads over a short
    probe of the cores this process may use. Sleeps PROBE_SECONDS."""
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    usable = usable_cores()
    if not Path("/proc/stat").exists():  # not Linux: no cheap view of the other processes
        return usable, f"{usable} usable cores"
    cores = affine_cores()
    before = read_cpu_times()
    time.sleep(PROBE_SECONDS)
    busy = busy_cores(before, read_cpu_times(), cores)
    threads = choose_threads(usable, len(cores), busy)
    return threads, (f"{usable} usable cores, {busy:.1f} kept busy by other processes "
                     f"(sampled over {PROBE_SECONDS} s; load average {os.getloadavg()[0]:.1f})")
