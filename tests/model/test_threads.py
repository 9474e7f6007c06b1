"""model/threads.py's decisions: how many threads, and the OpenMP wait policy (no timing)."""

import os
import subprocess
import sys
from pathlib import Path

from seekforge.model import threads

ROOT = Path(__file__).resolve().parents[2]


def test_usable_cores_is_the_affinity_capped_by_a_cgroup_quota():
    assert threads.usable_cores({0, 1, 2, 3}, "max 100000\n") == 4
    assert threads.usable_cores({0, 1, 2, 3}, "150000 100000\n") == 1  # docker --cpus 1.5: one whole core
    assert threads.usable_cores({0, 1, 2, 3}, "800000 100000\n") == 4  # a quota above the affinity
    assert threads.usable_cores({5}, "50000 100000\n") == 1  # never zero


def test_omp_num_threads_wins_over_the_cores():
    assert threads.default_threads({"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    assert threads.default_threads({"OMP_NUM_THREADS": "0"})[1] != "OMP_NUM_THREADS"  # not a count: ignored


def test_default_threads_are_the_usable_cores_busy_or_not(monkeypatch):
    # one thread has no barrier to stall, but it lost to two sleeping-at-barriers threads under load
    # (model/threads.py): the busy machine does not lower the count
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    assert threads.default_threads({}) == (6, "the 6 cores this process may use (CPU affinity, cgroup quota)")


def test_wait_policy_is_passive_on_a_busy_machine_only_and_the_user_wins(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as a fresh `seekforge` process, before it imports torch
    busy, quiet = {}, {}
    assert "PASSIVE" in threads.configure_openmp(busy, busy=1.7) and busy == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert "default (spin" in threads.configure_openmp(quiet, busy=0.1) and quiet == {}
    user = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert "as set" in threads.configure_openmp(user, busy=1.7) and user == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_busy_cores_from_two_proc_stat_samples():
    before = threads.read_cpu_times("cpu  1 2 3 4\ncpu0 100 0 0 900 0 0 0 0\ncpu1 0 0 0 1000 0 0 0 0\n")
    after = threads.read_cpu_times("cpu  1 2 3 4\ncpu0 150 0 0 950 0 0 0 0\ncpu1 100 0 0 1000 0 0 0 0\n")
    assert threads.busy_cores(before, after, {0, 1}) == 1.5  # half of core 0, all of core 1
    assert threads.busy_cores(before, after, {0}) == 0.5  # only the cores this process may use count


def test_wait_policy_left_alone_once_torch_is_imported():
    environ = {}
    why = threads.configure_openmp(environ, busy=2.0)
    # this test process imported torch already (conftest), so the policy is left alone and says so
    assert environ == {} and "torch was imported before" in why
    user = {"GOMP_SPINCOUNT": "10000"}
    assert "GOMP_SPINCOUNT=10000" in threads.configure_openmp(user) and user == {"GOMP_SPINCOUNT": "10000"}


def test_wait_policy_reaches_the_openmp_runtime_when_set_before_torch():
    # OMP_DISPLAY_ENV=VERBOSE: libgomp prints the settings it read when it loads (at `import torch`). Its
    # OMP_WAIT_POLICY line says PASSIVE by default too; the spin count tells: 300000 by default, 0 when passive.
    code = ("from seekforge.model import threads; print(threads.configure_openmp(busy=2.0))\n"
            "import torch; torch.ones(2).sum()")
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_POLICY_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, "PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "VERBOSE"})
    assert "PASSIVE (other processes keep 2.0 cores busy" in out.stdout
    assert "GOMP_SPINCOUNT = '0'" in out.stderr + out.stdout


def test_the_cli_sets_the_policy_before_the_verb_loads_torch():
    """A fresh `seekforge VERB` process decides before any verb module imports torch: here on a machine the probe
    finds busy, so libgomp's spin count must say passive."""
    env = {k: v for k, v in os.environ.items() if k not in (*threads.WAIT_POLICY_VARIABLES, "OMP_NUM_THREADS")}
    code = ("import sys; sys.argv = ['seekforge', 'generate', '--model', 'tiny', '--max-new-tokens', '2']\n"
            "from seekforge.model import threads; threads.others_busy_cores = lambda: 2.0  # a busy machine\n"
            "from seekforge.cli import main; main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         env={**env, "PYTHONPATH": str(ROOT), "OMP_DISPLAY_ENV": "VERBOSE"})
    assert "GOMP_SPINCOUNT = '0'" in out.stderr + out.stdout, out.stdout + out.stderr
