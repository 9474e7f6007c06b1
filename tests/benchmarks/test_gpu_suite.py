"""benchmarks/gpu/run.py --dry-run: the GPU suite runs end to end on the CPU with tiny shapes and prints
its one table with every row (the GPU numbers themselves need a GPU; nothing here times anything); with --check,
every check of the GPU path passes on CPU tensors, Triton interpreted."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_suite(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/run.py"), "--dry-run", *flags],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_gpu_suite_dry_run_prints_every_row():
    out = run_suite()
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("machine:") and "CPU capability" in lines[0]
    assert lines[1].startswith("dtype:")
    table = [line for line in lines if line.startswith("| ")]
    header = [c.strip() for c in table[0].split("|")[1:-1]]
    assert header[4:7] == ["launches/step", "host syncs/step", "GPU busy"]
    assert [row.split("|")[1].strip() for row in table[2:]] == [
        "train step", "decode batch-1 (graphs)", "decode batch-1 (eager)", "throughput", "prefix cache", "speculative"]
    cells = {row.split("|")[1].strip(): [c.strip() for c in row.split("|")[2:-1]] for row in table[2:]}
    assert "tok/s" in cells["train step"][0] and "MFU" in cells["train step"][0]
    assert cells["train step"][3].endswith(" ops") and cells["train step"][5] == "n/a (CPU)"
    assert "ms/token" in cells["decode batch-1 (graphs)"][0]
    assert "new tok/s" in cells["throughput"][0]
    assert "(on)" in cells["prefix cache"][0]
    assert "greedy identical 4/4" in out.stdout  # engine and transformers agree on the tiny model


def test_gpu_checks_pass_on_the_cpu():
    out = run_suite("--check")
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    checks = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(checks) == 6 and all(line.startswith("PASS") for line in checks), checks
