"""benchmarks/gpu/run.py --dry-run: the GPU suite runs end to end on the CPU with tiny shapes and prints
its one table with every row (the GPU numbers themselves need a GPU; nothing here times anything)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_suite_dry_run_prints_every_row():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/run.py"), "--dry-run"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("machine:") and "CPU capability" in lines[0]
    assert lines[1].startswith("dtype:")
    table = [line for line in lines if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in table[2:]] == ["train step", "decode batch-1", "throughput",
                                                             "prefix cache", "speculative"]
    cells = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in table[2:]}
    assert "tok/s" in cells["train step"] and "MFU" in cells["train step"]
    assert "ms/token" in cells["decode batch-1"]
    assert "new tok/s" in cells["throughput"]
    assert "(on)" in cells["prefix cache"]
    assert "greedy identical 4/4" in out.stdout  # engine and transformers agree on the tiny model
