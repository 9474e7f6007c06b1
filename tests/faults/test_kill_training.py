"""SIGKILL during training and during saves: rerunning the same command ends with the final loss
and weights of a run that was never killed; what is lost is only the steps since the last intact
checkpoint (they are recomputed)."""

from __future__ import annotations

import random
import subprocess
import time

import pytest
import torch

from seekforge.cli import main
from seekforge.model.hf import load_hf

from .conftest import INJECT, final_record, pretrain_args, python, subprocess_env

STEPS = 12


def _run(run_dir, fault: str = "", **popen) -> subprocess.Popen:
    env = subprocess_env(FAULT=fault) if fault else subprocess_env()
    return subprocess.Popen([python(), str(INJECT), *pretrain_args(run_dir, STEPS, 2)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("kills") / "straight"
    main(pretrain_args(run, STEPS, 2))
    return run


def _same_result(straight, run) -> None:
    assert final_record(run)["loss"] == final_record(straight)["loss"]
    ref, got = load_hf(straight / "hf").state_dict(), load_hf(run / "hf").state_dict()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["save:6:manifest", "save:6:latest", "kill:5"])
def test_kill_at_a_chosen_moment_then_rerun(straight, tmp_path, fault):
    run = tmp_path / "run"
    assert _run(run, fault).wait(timeout=300) == -9  # SIGKILLed where the fault says
    done = _run(run)
    assert done.wait(timeout=300) == 0, done.stderr.read()[-2000:]
    _same_result(straight, run)


def _lines(path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


@pytest.mark.slow
def test_ten_sigkills_at_random_moments(straight, tmp_path):
    """Each attempt is killed at a random moment of its training (0-1.5 s after it logs its first
    step: a step takes ~0.2-0.5 s here and every second step saves), then the same command runs
    again; after ten kills the last attempt runs to the end."""
    run, rng, kills = tmp_path / "run", random.Random(0), 0
    metrics = run / "metrics.jsonl"
    while kills < 10:
        before = _lines(metrics)
        proc = _run(run)
        while proc.poll() is None and _lines(metrics) == before:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is not None:
            break  # finished before this kill
        proc.kill()
        proc.wait()
        kills += 1
        latest = run / "checkpoints" / "latest"
        print(f"kill {kills}: {_lines(metrics) - before} step(s) logged by this attempt, latest="
              f"{latest.read_text().strip() if latest.exists() else None}, "
              f"partial saves left: {[p.name for p in (run / 'checkpoints').glob('*.tmp')]}")
    print(f"{kills} SIGKILLs")
    done = _run(run)
    assert done.wait(timeout=300) == 0, done.stderr.read()[-2000:]
    _same_result(straight, run)
