"""No code path unpickles: the lint rules that find pickle, marshal, unsafe YAML and torch.load
(pyproject.toml, [tool.ruff.lint]) pass over the package, the tests and the benchmarks. Part of the
test command so that a new torch.load(..., weights_only=False) cannot land unnoticed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = "S301,S302,S506,TID251"


def test_nothing_unpickles():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", RULES,
                           "seekforge", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_catch_torch_load_and_pickle(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import pickle\n\nimport torch\n\ntorch.load('x.pt')\npickle.loads(b'')\n")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           str(ROOT / "pyproject.toml"), "--select", RULES, str(probe)], capture_output=True, text=True)
    assert done.returncode == 1 and "torch.load" in done.stdout and "S301" in done.stdout, done.stdout
