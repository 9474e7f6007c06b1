"""`seekforge grpo --data prompts.jsonl --reward mymod:fn` on a user's own data and reward module (written to a
temp dir, imported from the current directory as `python -m` would): it trains, logs each reward's mean and
std, the completion lengths and pass@k, writes samples.jsonl, and a run split in two — by a rerun, or by a
reward that raised (the run's state saved at its last completed step) and was fixed — ends exactly where the
uninterrupted run does: the same metrics, samples and weights."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from seekforge.cli import main

REWARDS = '''
import os

CALLS = [0]


def exact_match(prompts, completions, answer, **columns):
    """TRL's batched signature; a share of the answer's digits, so that groups differ."""
    return [sum(d in c for d in a) / len(a) for c, a in zip(completions, answer)]


def odd_length(prompt, completion, level, **columns):
    """Per sample, a column of its own; explodes at the call EXPLODE_AT names (a judge going down)."""
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("EXPLODE_AT", "0")):
        raise ConnectionError("judge offline")
    return level * (len(completion) % 2)
'''

TIMINGS = {"rollout_tokens_per_s", "train_tokens_per_s", "rollout_time_s", "train_time_s"}


def tiny_base(directory) -> None:
    """A tiny byte-level HF checkpoint that `--base` loads."""
    from seekforge.config import preset
    from seekforge.model.hf import save_hf
    from seekforge.model.model import build_model
    from seekforge.model.tokenizer import load_tokenizer

    save_hf(build_model(preset("tiny", vocab_size=320, bos_token_id=256, eos_token_id=257), seed=0), directory)
    load_tokenizer("byte").save(directory)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A tiny byte-level base, prompts.jsonl and user_rewards.py, as the current directory."""
    tiny_base(tmp_path / "base")
    rows = [{"prompt": f"Q: {a} + {b} = ? A:", "answer": str(a + b), "level": 1 + a % 2}
            for a in range(3, 9) for b in (11, 25)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the rewards' import adds the current directory
    yield tmp_path
    sys.modules.pop("user_rewards", None)


def grpo(out_dir: str, steps: int):
    """One `seekforge grpo` process: its reward module imported afresh."""
    sys.modules.pop("user_rewards", None)
    main(["grpo", "--base", "base", "--data", "prompts.jsonl", "--reward", "user_rewards:exact_match",
          "--reward", "user_rewards:odd_length=0.5", "--out-dir", out_dir, "--steps", str(steps),
          "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "4", "--eval-k", "2",
          "--set", "eval_prompts=3", "--set", "eval_interval=2", "--set", "sample_interval=1",
          "--set", "save_interval=0", "--set", "kv_cache_memory=2MiB", "--set", "lr=3e-3", "--dtype", "fp32"])


def records(out_dir) -> list[dict]:
    from seekforge.train.metrics import read_metrics

    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items() if k not in TIMINGS}
            for r in read_metrics(f"{out_dir}/metrics.jsonl")]


def final_weights(out_dir, step: int) -> dict[str, torch.Tensor]:
    from seekforge.model.load import load_model
    from seekforge.train.checkpoint import load_checkpoint

    model, _ = load_model("base", torch.float32, "cpu")
    load_checkpoint(f"{out_dir}/checkpoints/step_{step:06d}", model)
    return model.state_dict()


def test_own_data_and_reward_module_train_log_and_resume_exactly(workdir, capsys, monkeypatch):
    grpo("full", 3)
    full = records("full")
    assert [r["step"] for r in full] == [0, 1, 2, 3]
    for key in ("reward_mean", "reward_std", "rewards/exact_match/mean", "rewards/exact_match/std",
                "rewards/odd_length/mean", "rewards/odd_length/std", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "response_length", "clip_fraction",
                "entropy", "reward_errors"):
        assert key in full[1], key
    assert "eval_pass@2" in full[0] and "eval_pass@2" in full[2] and "eval_accuracy" in full[3]
    samples = [json.loads(line) for line in (workdir / "full/samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 6 + [2] * 6 + [3] * 6
    assert set(samples[0]) == {"step", "prompt", "completion", "rewards", "reward", "advantage"}
    assert set(samples[0]["rewards"]) == {"exact_match", "odd_length"}
    s = samples[0]
    assert s["reward"] == pytest.approx(s["rewards"]["exact_match"] + 0.5 * s["rewards"]["odd_length"])

    grpo("split", 2)
    grpo("split", 3)  # a rerun resumes at step 2
    assert "resumed from" in capsys.readouterr().out
    assert records("split") == full
    assert (workdir / "split/samples.jsonl").read_text() == (workdir / "full/samples.jsonl").read_text()
    expected = final_weights("full", 3)
    for name, value in final_weights("split", 3).items():
        assert torch.equal(value, expected[name]), name

    # odd_length is called once per step (6 completions each): its 8th call is in step 2
    monkeypatch.setenv("EXPLODE_AT", "8")
    with pytest.raises(SystemExit) as exit_info:
        grpo("failed", 3)
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # the progress bar aside
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("seekforge grpo: error: "), err
    assert "reward 'user_rewards:odd_length' raised ConnectionError: judge offline (at " in err[0]
    assert "scoring completion 2 of 6 (1 failed)" in err[0]
    assert "the run's state at step 1 is saved in failed/checkpoints; fix the reward and rerun" in err[0]
    assert (workdir / "failed/checkpoints/step_000001").is_dir() and [r["step"] for r in records("failed")] == [0, 1]
    monkeypatch.delenv("EXPLODE_AT")
    grpo("failed", 3)  # the reward fixed: resumes at step 1 and ends as the uninterrupted run
    assert records("failed") == full


@pytest.mark.parametrize("argv, message", [
    (["--data", "nope.jsonl"], "data='nope.jsonl': no such file"),
    (["--reward", "no_such_module:f"], "reward 'no_such_module:f': no module named 'no_such_module'"),
    (["--reward", "user_rewards:nope"], "reward 'user_rewards:nope': user_rewards has no 'nope' (its functions: "
                                        "exact_match, odd_length)"),
    (["--reward", "user_rewards:exact_match=heavy"], "--reward user_rewards:exact_match=heavy: the weight after"),
    (["--reward", "format=2", "--set", "reward_weights=[1]"], "give the rewards' weights one way"),
    (["--eval-data", "held.csv"], "eval_data='held.csv': give 'builtin:arithmetic', a .jsonl or .parquet"),
    (["--reward-errors", "ignore"], "GRPOConfig.reward_errors='ignore': choose one of ('raise', 'zero')"),
])
def test_user_data_mistakes_are_one_line_before_any_model(workdir, capsys, argv, message):
    sys.modules.pop("user_rewards", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--base", "base", "--data", "prompts.jsonl", "--out-dir", "run", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not (workdir / "run").exists()


def test_a_missing_prompt_column_is_one_line(workdir, capsys):
    (workdir / "q.jsonl").write_text('{"question": "1 + 1?"}\n')
    with pytest.raises(SystemExit):
        main(["grpo", "--base", "base", "--data", "q.jsonl", "--out-dir", "run", "--steps", "1"])
    assert 'q.jsonl:1: "prompt" must be text or a non-empty list of' in capsys.readouterr().err


_CALLS = [0]


def rank_one_fails(prompts, completions, **columns):
    """Fails on rank 1 only, in step 2: the other rank must stop too, not wait in the next collective."""
    import torch.distributed as dist

    _CALLS[0] += 1
    if dist.get_rank() == 1 and _CALLS[0] == 2:
        raise TimeoutError("judge timed out")
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _failing_two_rank_run(out_dir: str):
    from seekforge.rl.rewards import RewardError
    from tests.rl.test_trainer import make_trainer, small_config

    trainer = make_trainer(small_config(None, out_dir=out_dir, steps=3, eval_prompts=0, save_interval=0,
                                        rewards=[f"{__name__}:rank_one_fails"]))
    try:
        trainer.fit(progress=False)
    except RewardError as e:
        return e.reward, str(e), trainer.step_count
    return None


@pytest.mark.slow  # ~10 s: two spawned ranks
def test_a_reward_failing_on_one_rank_stops_every_rank_after_a_collective_save(tmp_path):
    from tests.dist.dist_launcher import launch

    results = launch(_failing_two_rank_run, 2, str(tmp_path / "run"))
    assert results[0] == results[1] and results[0][0] == f"{__name__}:rank_one_fails" and results[0][2] == 1
    assert "raised TimeoutError: judge timed out" in results[0][1] and "(on rank 1)" in results[0][1]
    assert "the run's state at step 1 is saved" in results[0][1]
    assert (tmp_path / "run/checkpoints/step_000001").is_dir()
