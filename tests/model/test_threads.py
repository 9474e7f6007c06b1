"""model/threads.py's decisions: how many threads on how busy a machine, and the OpenMP wait policy (no timing)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from seekforge.model import threads

ROOT = Path(__file__).resolve().parents[2]

STAT = """cpu  300 0 100 500 0 0 0 0 0 0
cpu0 100 0 50 250 0 0 0 0 0 0
cpu1 200 0 50 250 0 0 0 0 0 0
intr 1 2 3
"""


@pytest.mark.parametrize("usable, cores, busy, expected", [
    (2, 2, 0.0, 2),   # quiet: every core
    (2, 2, 0.4, 2),   # a neighbour's occasional work does not take a core
    (2, 2, 0.5, 1),   # half a core busy: it counts as taken
    (2, 2, 2.0, 1),   # both cores busy (two busy loops): one thread, never zero
    (2, 2, 1.9, 1),
    (16, 16, 3.2, 13),
    (4, 16, 10.0, 4),  # a quota of 4 cores, with 6 of the 16 left free: the quota decides
    (4, 16, 14.0, 2),
])
def test_one_thread_per_core_the_others_leave_free(usable, cores, busy, expected):
    assert threads.choose_threads(usable, cores, busy) == expected


def test_usable_cores_is_the_affinity_capped_by_a_cgroup_quota():
    assert threads.usable_cores({0, 1, 2, 3}, "max 100000\n") == 4
    assert threads.usable_cores({0, 1, 2, 3}, "150000 100000\n") == 1  # docker --cpus 1.5: one whole core
    assert threads.usable_cores({0, 1, 2, 3}, "800000 100000\n") == 4  # a quota above the affinity
    assert threads.usable_cores({5}, "50000 100000\n") == 1  # never zero


def test_busy_cores_counts_only_this_process_s_cores():
    before = threads.read_cpu_times(STAT)
    assert before == {0: (150, 400), 1: (250, 500)}
    # over the sample: cpu0 fully busy (100 of 100 jiffies), cpu1 a quarter busy (25 of 100)
    after = {0: (250, 500), 1: (275, 600)}
    assert threads.busy_cores(before, after, {0, 1}) == pytest.approx(1.25)
    assert threads.busy_cores(before, after, {1}) == pytest.approx(0.25)


def test_iowait_is_idle_and_steal_is_busy():
    stat = "cpu0 10 0 0 50 40 0 0 0 0 0\ncpu1 10 0 0 50 0 0 0 40 0 0\n"
    assert threads.read_cpu_times(stat) == {0: (10, 100), 1: (50, 100)}


def test_omp_num_threads_wins_over_the_probe():
    assert threads.default_threads({"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")


def test_default_threads_is_within_the_usable_cores():
    count, why = threads.default_threads({})
    assert 1 <= count <= threads.usable_cores()
    assert "usable cores" in why


def test_wait_policy_set_passive_unless_the_user_chose():
    environ = {}
    why = threads.configure_openmp(environ)
    # this test process imported torch already (conftest), so the policy is left alone and says so
    assert environ == {} and "torch was imported before" in why
    user = {"GOMP_SPINCOUNT": "10000"}
    assert "GOMP_SPINCOUNT=10000" in threads.configure_openmp(user) and user == {"GOMP_SPINCOUNT": "10000"}


def test_wait_policy_reaches_the_openmp_runtime_when_set_before_torch():
    # OMP_DISPLAY_ENV: libgomp prints the settings it read when it loads (at `import torch`)
    code = ("from seekforge.model import threads; print(threads.configure_openmp())\n"
            "import torch; torch.ones(2).sum()")
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_POLICY_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, "PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "TRUE"})
    assert "PASSIVE (idle threads sleep" in out.stdout
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stderr + out.stdout
