"""benchmarks/serve_load.py: its background load ends with its block (and by itself), and a --dry-run prints every
row of the table (tiny model, eager; nothing here asserts a timing)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_load  # noqa: E402


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_background_load_is_killed_when_its_block_ends(monkeypatch):
    started = []
    popen = subprocess.Popen

    def record(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(serve_load.subprocess, "Popen", record)
    with pytest.raises(RuntimeError), serve_load.background_load(2, seconds=60):
        assert len(started) == 2 and all(loop.poll() is None for loop in started)
        raise RuntimeError("a measurement failed")  # the loops end all the same
    assert all(loop.returncode is not None and not running(loop.pid) for loop in started)


def test_a_busy_loop_ends_by_itself():
    loop = subprocess.Popen([sys.executable, "-c", serve_load.BUSY_LOOP.format(seconds=0.2)])
    start = time.monotonic()
    assert loop.wait(timeout=60) == 0 and time.monotonic() - start < 60


@pytest.mark.slow
def test_dry_run_prints_every_row(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/serve_load.py"), "--dry-run", "--load-seconds", "120",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("machine:") and "load average" in out.stdout.splitlines()[0]
    table = [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")][1:]
    assert table == [label for label, *_ in serve_load.ROWS]
    assert "PASSIVE" in out.stdout and "loaded / quiet" in out.stdout  # started beside the busy loops: passive
