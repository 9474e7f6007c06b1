"""Shared pieces of the fault-injection suite: the tiny pretraining command every fault reruns, and
the damage a disk or a copy can do to a file."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
INJECT = Path(__file__).with_name("inject.py")  # `python inject.py VERB ...`: seekforge + env-driven faults


def pretrain_args(out_dir, steps: int = 6, save_interval: int = 2, *extra: str) -> list[str]:
    return ["pretrain", "--preset", "tiny", "--data", "builtin:arithmetic", "--seq-len", "32",
            "--micro-batch-size", "4", "--steps", str(steps), "--dtype", "fp32", "--out-dir", str(out_dir),
            "--set", "peak_flops=1e11", "--set", "log_interval=0", "--set", "eval_interval=0",
            "--set", f"save_interval={save_interval}", "--set", "sample_prompt=", *extra]


def final_record(run_dir: Path) -> dict:
    """The last metrics line of the run's last step (a resumed run appends the steps it redoes)."""
    records = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return records[max(records)]


def subprocess_env(**extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", **extra}
    return env


def python() -> str:
    return sys.executable


def truncate(path: Path, keep: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * keep))


def flip_bit(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


@pytest.fixture(scope="module")
def tiny_model():
    from seekforge.config import preset
    from seekforge.model.model import build_model

    torch.set_num_threads(1)
    return build_model(preset("tiny"), seed=0).eval()


@pytest.fixture(scope="module")
def byte_tokenizer():
    from seekforge.model.tokenizer import load_tokenizer

    return load_tokenizer("byte")
