"""benchmarks/ep_overlap.py end to end at tiny sizes: it prints the machine, both contenders' step times, the
ratio, and finds the two trainers' outputs bit-identical (the timings themselves are not checked)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ep_overlap_benchmark_runs_and_outputs_match():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["--reps", "2", "--warmup", "0", "--hidden", "64", "--layers", "2", "--seq", "16", "--grad-accum", "3"]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/ep_overlap.py"), *args], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("machine:") and "load average" in out.stdout and "dtype: fp32" in out.stdout
    assert "ratio sequential / overlap:" in out.stdout
    assert "losses and grad norms bit-identical over 2 steps: yes" in out.stdout
