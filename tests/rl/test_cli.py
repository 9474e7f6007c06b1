"""`seekforge grpo`: config file + --set, bad configs fail before any model is built with one message,
and a short end-to-end run (own base model, GRPO, metrics, plot, checkpoint) that resumes."""

from __future__ import annotations

import json

import pytest

from seekforge.cli import main
from seekforge.rl.config import load_grpo_config
from seekforge.train.metrics import read_metrics


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("group_size: 4\nlr: 1e-5\nrewards: [arithmetic, format]\nreward_weights: [1, 0.2]\n"
                    "model:\n  hidden_size: 64\n")
    cfg = load_grpo_config(path, ["group_size=6", "model.num_hidden_layers=2", "rewards=boxed", "reward_weights=1"])
    assert (cfg.group_size, cfg.lr, cfg.rewards, cfg.reward_weights) == (6, 1e-5, ["boxed"], [1.0])
    assert cfg.model == {"hidden_size": 64, "num_hidden_layers": 2}
    toml = tmp_path / "grpo.toml"
    toml.write_text('loss_type = "dr_grpo"\nscale_rewards = false\n')
    assert load_grpo_config(toml).loss_type == "dr_grpo"
    with pytest.raises(ValueError, match=r"unknown GRPOConfig key\(s\) \['gruop_size'\]"):
        load_grpo_config(None, ["gruop_size=4"])
    with pytest.raises(ValueError, match="GRPOConfig.steps='many': expected an integer"):
        load_grpo_config(None, ["steps=many"])


def test_grpo_config_is_checked_by_the_loader_pretrain_uses(tmp_path):
    """One loader and type check for both verbs' configs (train/config_file.load_config): list items too."""
    for overrides, message in [
        (["reward_weights=[1, heavy]"], r"GRPOConfig.reward_weights\[1\]='heavy': expected a number"),
        (["task_levels=[1.5]"], r"GRPOConfig.task_levels\[0\]=1.5: expected an integer"),
        ({"model": 3}, "GRPOConfig.model=3: expected a mapping of ModelConfig keys"),
        (["swap=1"], "GRPOConfig.swap=1: expected true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_grpo_config(None, overrides)
    assert load_grpo_config(None, ["task_levels=2", "reward_weights=[1]"]).task_levels == [2]


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "1"], "GRPOConfig.group_size=1: must be an integer >= 2"),
    (["--set", "clip_high=-0.2"], "GRPOConfig.clip_high=-0.2: must be >= 0"),
    (["--reward", "no_such_reward"], "unknown reward 'no_such_reward'"),
    (["--set", "base_slip_share=1.5"], "GRPOConfig.base_slip_share=1.5: must be in [0, 1]"),
])
def test_bad_config_is_one_message_before_any_model(argv, message, tmp_path, capsys, monkeypatch):
    import seekforge.rl.base as base

    monkeypatch.setattr(base, "prepare_base", lambda *a, **k: pytest.fail("built a model for a bad config"))
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--out-dir", str(tmp_path / "run"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # ~25 s on the shared 2 cores: two CLI runs, a base pretrain, DCP saves
def test_short_run_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["grpo", "--out-dir", str(out), "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "4",
              "--set", "base_steps=3", "--set", "eval_prompts=4", "--set", "eval_interval=1",
              "--set", "model.num_hidden_layers=2", "--set", "kv_cache_memory=2MiB"]
    main([*common, "--steps", "2"])
    text = capsys.readouterr().out
    assert "held-out accuracy:" in text and (out / "reward.png").exists() and (out / "base" / "hf").is_dir()
    assert any((out / "tensorboard").iterdir())
    main([*common, "--steps", "3"])  # resumes at step 2, runs one more
    assert "resumed from" in capsys.readouterr().out
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for key in ("reward_mean", "reward_std", "eval_accuracy", "zero_std_groups", "clip_fraction", "entropy",
                "response_length", "rollout_tokens_per_s", "train_tokens_per_s"):
        assert key in records[-1], key
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
    main([*common, "--steps", "3"])  # finished: says so, trains nothing
    assert "nothing to train" in capsys.readouterr().out and len(read_metrics(out / "metrics.jsonl")) == 4


def test_a_directory_holding_another_models_run_is_refused(tmp_path, capsys):
    """Resuming keeps the stored model: --base of another model into that --out-dir would silently train the old
    one (the README's second snippet once did, ending in a size-mismatch traceback)."""
    from seekforge.config import preset
    from seekforge.model.hf import save_hf
    from seekforge.model.model import build_model
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.train.checkpoint import save_checkpoint

    byte = dict(vocab_size=320, bos_token_id=256, eos_token_id=257)
    save_hf(build_model(preset("tiny", **byte), seed=0), tmp_path / "base")
    load_tokenizer("byte").save(tmp_path / "base")
    save_checkpoint(tmp_path / "run" / "checkpoints", 1, build_model(preset("tiny", num_hidden_layers=2, **byte)))
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--base", str(tmp_path / "base"), "--out-dir", str(tmp_path / "run"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "holds a run of another model" in err and "--out-dir DIR" in err, err
