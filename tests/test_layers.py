"""The layer contract (pyproject.toml [tool.importlinter], docs/ARCHITECTURE.md): imports flow downward."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # this tree's seekforge, not an installed one
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=root, env=env, capture_output=True, text=True)


def test_layers_contract_is_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "seekforge", tmp_path / "seekforge", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    info = tmp_path / "seekforge" / "model" / "info.py"
    info.write_text(info.read_text() + "\nimport seekforge.train.trainer  # model → train: upward\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "seekforge.model.info -> seekforge.train.trainer" in result.stdout, result.stdout
