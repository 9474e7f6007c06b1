import pytest
import torch

from seekforge.cli import main
from seekforge.errors import CorruptFileError
from seekforge.model.model import build_model
from seekforge.train import checkpoint as ckpt_module
from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from seekforge.train.optim import build_optimizer
from seekforge.train.trainer import Trainer

from .conftest import tiny_train_config

CURVES = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm", "lr")


def test_resume_is_bitwise_exact(tmp_path, make_loader):
    """N steps straight vs k steps, stop, resume in a fresh process-like setup, continue to N."""
    steps, stop = 6, 3
    straight_cfg = tiny_train_config(tmp_path / "a", steps=steps)
    straight = Trainer(straight_cfg, build_model(straight_cfg.model_config(), seed=0), make_loader(straight_cfg))
    full = straight.fit()

    cfg = tiny_train_config(tmp_path / "b", steps=steps)
    first = Trainer(cfg, build_model(cfg.model_config(), seed=0), make_loader(cfg)).fit(stop_at=stop)
    torch.manual_seed(1234)  # disturb the global RNG: resume must restore it
    # A differently initialized model and a fresh loader: everything must come from the checkpoint.
    resumed = Trainer(cfg, build_model(cfg.model_config(), seed=99), make_loader(cfg))
    assert resumed.resume() and resumed.step == stop
    second = resumed.fit()

    assert len(first) == stop and len(second) == steps - stop
    for key in CURVES:
        assert [m[key] for m in full] == [m[key] for m in first + second], key  # bitwise: ==, not approx
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    for a, b in zip(straight.model.moe_layers(), resumed.model.moe_layers(), strict=True):
        assert torch.equal(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)


def test_resume_follows_the_resumed_runs_schedule(tmp_path, make_loader):
    """A resume that changes the schedule (a longer run, another peak lr) takes it from the step reached: no lr of
    the saved run's schedule carries over (its optimizer's next lr, its scheduler's peak)."""
    from seekforge.train.optim import lr_at

    cfg = tiny_train_config(tmp_path, steps=4, lr=2e-3)
    Trainer(cfg, build_model(cfg.model_config(), seed=0), make_loader(cfg)).fit()
    longer = tiny_train_config(tmp_path, steps=10, lr=1e-3)
    resumed = Trainer(longer, build_model(longer.model_config(), seed=0), make_loader(longer))
    assert resumed.resume() and resumed.step == 4
    lrs = [m["lr"] for m in resumed.fit()]
    assert lrs == pytest.approx([lr_at(step, longer.optimizer_config()) for step in range(4, 10)], rel=1e-12)


def test_a_missing_latest_file_resumes_from_the_newest_step(tmp_path, capsys):
    _, model, optimizer, scheduler = _tiny_state(tmp_path)
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, model, optimizer, scheduler)
    (root / "latest").unlink()
    assert latest_checkpoint(root) == root / "step_000002"
    assert "latest is missing" in capsys.readouterr().err
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def _tiny_state(tmp_path):
    cfg = tiny_train_config(tmp_path)
    model = build_model(cfg.model_config(), seed=0)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer_config())
    return cfg, model, optimizer, scheduler


@pytest.mark.parametrize("crash_point", ["rng_state", "_write_latest"])  # after DCP shards; after the rename
def test_crash_mid_save_keeps_latest_loadable(tmp_path, monkeypatch, crash_point):
    _, model, optimizer, scheduler = _tiny_state(tmp_path)
    root = tmp_path / "checkpoints"
    good = save_checkpoint(root, 1, model, optimizer, scheduler)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(*args, **kwargs):  # the DCP shards are written; the process dies before finishing
        raise RuntimeError("simulated crash (disk full / preempted)")

    monkeypatch.setattr(ckpt_module, crash_point, crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(root, 2, model, optimizer, scheduler)
    monkeypatch.undo()

    if crash_point == "rng_state":
        assert (root / "step_000002.tmp").is_dir() and not (root / "step_000002").exists()
    assert latest_checkpoint(root) == good
    fresh = build_model(model.cfg, seed=5)
    assert load_checkpoint(latest_checkpoint(root), fresh) == 1
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name]), name

    save_checkpoint(root, 3, model, optimizer, scheduler)  # the next good save cleans up the debris
    assert not (root / "step_000002.tmp").exists() and latest_checkpoint(root).name == "step_000003"


def test_keeps_last_k(tmp_path):
    _, model, optimizer, scheduler = _tiny_state(tmp_path)
    root = tmp_path / "checkpoints"
    for step in range(1, 5):
        save_checkpoint(root, step, model, optimizer, scheduler, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    assert (root / "latest").read_text().strip() == "step_000004"


def test_weights_only_checkpoint_starts_a_fresh_run(tmp_path):
    cfg, model, _, _ = _tiny_state(tmp_path)
    path = save_checkpoint(tmp_path / "checkpoints", 0, model)  # what `seekforge convert` writes
    fresh = build_model(cfg.model_config(), seed=7)
    optimizer, scheduler = build_optimizer(fresh, cfg.optimizer_config())
    assert load_checkpoint(path, fresh, optimizer, scheduler) == 0
    assert optimizer.state == {} and scheduler.last_epoch == 0
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_not_a_checkpoint_is_a_value_error(tmp_path):
    _, model, _, _ = _tiny_state(tmp_path)
    with pytest.raises(ValueError, match="not a DCP checkpoint"):
        load_checkpoint(tmp_path, model)


def _checkpoints(root, steps):
    cfg = tiny_train_config(root)
    model = build_model(cfg.model_config(), seed=0)
    for step in steps:
        save_checkpoint(root, step, model)


def _damage(step_dir):
    (step_dir / ".metadata").unlink()


def test_no_fallback_advice_is_one_that_works(tmp_path):
    root = tmp_path / "checkpoints"
    _checkpoints(root, [1, 2])
    _damage(root / "step_000002")
    with pytest.raises(CorruptFileError, match="Drop --no-checkpoint-fallback to resume from step_000001"):
        latest_checkpoint(root, fallback=False)
    _damage(root / "step_000001")  # no intact one left: dropping the flag cannot help, so it is not suggested
    with pytest.raises(CorruptFileError) as info:
        latest_checkpoint(root, fallback=False)
    assert "no older intact checkpoint" in str(info.value) and "--no-checkpoint-fallback" not in str(info.value)
    assert "--no-resume" in str(info.value)


def test_verify_fails_a_latest_that_points_nowhere(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    _checkpoints(root, [1])
    main(["checkpoint", "verify", str(tmp_path / "run")])
    assert "1 usable, 0 damaged" in capsys.readouterr().out
    (root / "latest").write_text("step_000009\n")
    with pytest.raises(SystemExit) as info:
        main(["checkpoint", "verify", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert info.value.code == 1 and "'step_000009'" in out and str(root / "latest") in out, out
