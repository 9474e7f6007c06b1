"""Dead and hung ranks under `torchrun --max-restarts 1` on gloo: a rank SIGKILLed (or hung) at a
step on the first attempt stops the job within a bounded time, the hung one is named, and the
restarted job resumes from the last checkpoint and ends with the uninterrupted run's final loss."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from seekforge.cli import main

from .conftest import INJECT, final_record, pretrain_args, python, subprocess_env

LOSS_TOL = 1e-5  # FSDP on 2 ranks vs one process: reduction order only (tests/dist/test_pretrain_cli.py)


def torchrun(run_dir, fault: str = "", *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", str(INJECT), *pretrain_args(run_dir, 6, 2, "--parallel", "dp_shard=2",
                                                                    "--set", "export_hf=false", *extra)]
    env = subprocess_env(FAULT=fault, FAULT_RANK="1") if fault else subprocess_env()
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run = tmp_path_factory.mktemp("elastic") / "single"
    main(pretrain_args(run, 6, 2, "--set", "export_hf=false"))
    return final_record(run)


def stop_latency(stderr: str) -> float:
    """Seconds from the injected fault to torchrun's report of the failed worker (its log's clock)."""
    injected = float(re.search(r"inject: \w+ rank \d+ before step \d+ at ([0-9.]+)", stderr).group(1))
    hms = re.search(r"E\d{4} (\d+):(\d+):([0-9.]+) .*failed \(exitcode", stderr).groups()
    day = time.time() - time.time() % 86400 + time.timezone  # torchrun logs local wall-clock time
    reported = day + int(hms[0]) * 3600 + int(hms[1]) * 60 + float(hms[2])
    return (reported - injected) % 86400


def _attempts(run_dir) -> list[int]:
    """Per metrics line, the step: a restarted job appends the steps it redoes."""
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_killed_rank_restarts_from_checkpoint_with_same_loss(single, tmp_path):
    run = tmp_path / "killed"
    done = torchrun(run, "kill:4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr and "local_rank: 1" in done.stderr  # torchrun saw the SIGKILL
    assert "resumed from" in done.stdout and "step_000002" in done.stdout
    print(f"killed rank 1 before step 4: torchrun reported the failure {stop_latency(done.stderr):.1f} s later")
    assert _attempts(run) == [1, 2, 3, 3, 4, 5, 6]  # step 3 redone from the step-2 checkpoint: nothing else lost
    got = final_record(run)
    for key in ("loss", "lm_loss", "mtp_loss"):
        assert abs(got[key] - single[key]) <= LOSS_TOL, (key, got[key], single[key])


@pytest.mark.slow
def test_hung_rank_is_named_then_restarted(single, tmp_path):
    run = tmp_path / "hung"
    done = torchrun(run, "hang:4", "--set", "dist_timeout_s=8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank(s) 1 did not respond: hung or dead" in done.stderr, done.stderr[-3000:]
    print(f"hung rank 1 before step 4 (timeout 8 s): failure reported {stop_latency(done.stderr):.1f} s later")
    got = final_record(run)
    assert abs(got["loss"] - single["loss"]) <= LOSS_TOL


@pytest.mark.slow
def test_killed_run_equals_uninterrupted_two_rank_run_exactly(tmp_path):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert torchrun(clean).returncode == 0
    assert torchrun(killed, "kill:3").returncode == 0
    assert final_record(killed) | {"tokens_per_s": 0, "step_time_s": 0, "mfu": 0} == \
        final_record(clean) | {"tokens_per_s": 0, "step_time_s": 0, "mfu": 0}
