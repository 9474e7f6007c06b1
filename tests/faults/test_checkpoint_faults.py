"""Damaged and failed checkpoints: a truncated, bit-flipped or missing file in the latest checkpoint
is named and the run resumes from the newest intact one (same final weights as a run that never
failed); --no-checkpoint-fallback turns that into one clean error; a save that hits a full disk or a
permission error leaves the previous checkpoint and `latest` as they were and says why."""

from __future__ import annotations

import errno
import shutil

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from seekforge.cli import main
from seekforge.errors import CorruptFileError
from seekforge.model.hf import load_hf
from seekforge.model.model import build_model
from seekforge.train import checkpoint as ckpt_module
from seekforge.train.checkpoint import CheckpointSaveError, latest_checkpoint, load_checkpoint, save_checkpoint
from tests.train.conftest import tiny_train_config

from .conftest import final_record, flip_bit, pretrain_args, truncate


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning" in line.lower()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps, checkpoints at 2, 4 and 6 (keep 2: step_000004 and step_000006 remain)."""
    run = tmp_path_factory.mktemp("faults") / "straight"
    main(pretrain_args(run))
    return run


def _same_weights(a, b) -> None:
    ref, got = load_hf(a / "hf").state_dict(), load_hf(b / "hf").state_dict()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def _copy_with_damaged_latest(straight, tmp_path, damage):
    """A copy of the finished run whose latest checkpoint (step 6) has one shard damaged → (run, shard)."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    shard = next((run / "checkpoints" / "step_000006").glob("*.distcp"))
    damage(shard)
    return run, shard


def test_truncated_latest_resumes_from_previous_with_one_warning(straight, tmp_path, capsys):
    run, shard = _copy_with_damaged_latest(straight, tmp_path, truncate)
    capsys.readouterr()
    main(pretrain_args(run))  # the same command again
    out, err = capsys.readouterr()
    warnings = _warnings(err)
    assert len(warnings) == 1 and str(shard) in warnings[0] and "truncated" in warnings[0], err
    assert "resumed from" in out and "step_000004" in out
    _same_weights(straight, run)
    assert final_record(run)["loss"] == final_record(straight)["loss"]


def test_no_fallback_is_one_clean_error(straight, tmp_path, capsys):
    run, shard = _copy_with_damaged_latest(straight, tmp_path, flip_bit)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(pretrain_args(run, 6, 2, "--no-checkpoint-fallback"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and str(shard) in err and "sha256" in err and "Traceback" not in err, err


def _two_checkpoints(root):
    cfg = tiny_train_config(root)
    model = build_model(cfg.model_config(), seed=0)
    save_checkpoint(root, 1, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_checkpoint(root, 2, model)
    return model


DAMAGE = {
    "truncated shard": lambda d: truncate(next(d.glob("*.distcp"))),
    "flipped bit": lambda d: flip_bit(next(d.glob("*.distcp"))),
    "deleted metadata": lambda d: (d / ".metadata").unlink(),
    "empty rng file": lambda d: truncate(d / "rank0.rng.json", 0.0),
    "garbage manifest": lambda d: (d / "manifest.json").write_text("{not json"),
    "directory gone": lambda d: shutil.rmtree(d),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_damage_is_named_and_falls_back(tmp_path, damage, capsys):
    root = tmp_path / "checkpoints"
    _two_checkpoints(root)
    DAMAGE[damage](root / "step_000002")
    capsys.readouterr()
    assert latest_checkpoint(root) == root / "step_000001"
    warnings = _warnings(capsys.readouterr().err)
    assert len(warnings) == 1 and "step_000002" in warnings[0], warnings
    with pytest.raises(CorruptFileError, match="step_000002") as info:
        latest_checkpoint(root, fallback=False)
    assert info.value.path.is_relative_to(root)


def test_nothing_intact_left_is_an_error(tmp_path):
    root = tmp_path / "checkpoints"
    _two_checkpoints(root)
    for step in (1, 2):
        truncate(next((root / f"step_{step:06d}").glob("*.distcp")))
    with pytest.raises(CorruptFileError, match="no older intact checkpoint.*--no-resume"):
        latest_checkpoint(root)


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _no_permission(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")


@pytest.mark.parametrize("where, fault", [
    ("dcp writer", "disk full"), ("manifest", "disk full"), ("rng file", "disk full"), ("mkdir", "permission"),
])
def test_failed_save_leaves_previous_and_latest(tmp_path, monkeypatch, where, fault):
    root = tmp_path / "checkpoints"
    model = _two_checkpoints(root)
    before = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    raise_it = _disk_full if fault == "disk full" else _no_permission
    target = {"dcp writer": (dcp_fs, "_write_item"), "manifest": (ckpt_module.integrity, "write_manifest"),
              "rng file": (ckpt_module, "rng_state"), "mkdir": (type(root), "mkdir")}[where]
    monkeypatch.setattr(*target, raise_it)
    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(root, 3, model)
    monkeypatch.undo()
    message = str(info.value)
    assert ("No space left" if fault == "disk full" else "Permission denied") in message, message
    assert "step_000002 and `latest` are untouched" in message
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == before  # no .tmp left, nothing touched
    fresh = build_model(model.cfg, seed=3)
    assert load_checkpoint(latest_checkpoint(root), fresh) == 2
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_disk_full_mid_run_then_rerun_matches(straight, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    write_item = dcp_fs._write_item

    def fills_up(*args, **kwargs):  # the disk fills during the second save (step 4)
        if saves["n"] >= 2:
            _disk_full()
        return write_item(*args, **kwargs)

    saves = {"n": 0}
    dcp_save = ckpt_module.dcp.save

    def counting_save(*args, **kwargs):
        saves["n"] += 1
        return dcp_save(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", fills_up)
    monkeypatch.setattr(ckpt_module.dcp, "save", counting_save)
    with pytest.raises(SystemExit) as info:
        main(pretrain_args(run))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "No space left on device" in err and "step_000002 and `latest` are untouched" in err
    assert "Traceback" not in err
    monkeypatch.undo()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not list((run / "checkpoints").glob("*.tmp"))
    main(pretrain_args(run))  # space freed: the same command resumes from step 2
    _same_weights(straight, run)


def test_verify_verb_prints_a_table(straight, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    main(["checkpoint", "verify", str(run)])
    out = capsys.readouterr().out
    assert "step_000006 (latest)" in out and "2 usable, 0 damaged" in out
    truncate(run / "checkpoints" / "step_000004" / "rank0.rng.json")
    with pytest.raises(SystemExit) as info:
        main(["checkpoint", "verify", str(run)])
    out = capsys.readouterr().out
    assert info.value.code == 1 and "rank0.rng.json: truncated" in out and "1 usable, 1 damaged" in out
