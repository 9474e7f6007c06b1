"""Prompt datasets (rl/data.py): a JSONL file of prompts trains like the built-in task, its other columns
reach the rewards, its order is a pure function of the seed and the step (so a resumed run draws what the
uninterrupted one drew), its held-out lines are never trained on, and bad files fail with one message."""

from __future__ import annotations

import json

import pytest

from seekforge.cli import main
from seekforge.rl.data import ArithmeticPrompts, JsonlPrompts, prompt_dataset
from seekforge.rl.rewards import arithmetic_reward
from tests.rl.test_trainer import make_trainer, small_config

SEEN_COLUMNS: list[set[str]] = []


def column_reward(prompt, completion, answer, level, **meta):
    """Uses the file's columns: digits of the answer found in the completion, scaled by the row's level."""
    SEEN_COLUMNS.append({"answer", "level", *meta})
    return level * sum(ch in completion for ch in answer) / len(answer) + sum(map(ord, completion)) % 7 / 70


def write_prompts(path, count: int):
    rows = [{"prompt": f"Q: {i} + {i + 1} = ?\nA:", "answer": str(2 * i + 1), "level": 1 + i % 2} for i in range(count)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_jsonl_prompts_train_and_resume_exactly(tmp_path):
    data = write_prompts(tmp_path / "prompts.jsonl", 12)
    common = dict(data=str(data), rewards=[f"{__name__}:column_reward"], eval_prompts=3, steps=3, save_interval=1)
    SEEN_COLUMNS.clear()
    full = make_trainer(small_config(tmp_path, **common)).fit(progress=False)
    assert SEEN_COLUMNS and all(columns == {"answer", "level"} for columns in SEEN_COLUMNS)
    assert full[-1]["eval_accuracy"] >= 0 and full[-1]["reward_mean"] > 0

    split = small_config(tmp_path, **common, out_dir=str(tmp_path / "split"))
    first = make_trainer(split).fit(stop_at=1, progress=False)
    resumed = make_trainer(split)
    assert resumed.resume() and resumed.step_count == resumed.prompt_stream.position == 1
    second = resumed.fit(progress=False)
    keys = ["reward_mean", "reward/column_reward", "loss", "clip_fraction", "response_length", "eval_accuracy"]
    for a, b in zip(full, first + second, strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}

    write_prompts(data, 13)  # another file under the same name: resuming on it would train on other prompts
    with pytest.raises(ValueError, match="another version of .*prompts.jsonl.*--no-resume"):
        make_trainer(split).resume()


def test_jsonl_order_is_seeded_epochs_and_leaves_out_the_held_out_lines(tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 10)
    dataset = JsonlPrompts(data, seed=0, num_eval=3, grade_reward=arithmetic_reward)
    held_out = {s.prompt for s in dataset.eval_set}
    steps = [dataset.prompts(step, 4) for step in range(7)]  # 28 prompts: four epochs of the 7 training lines
    drawn = [s.prompt for step in steps for s in step]
    assert len(held_out) == 3 and not held_out & set(drawn)
    for epoch in range(4):
        assert len(set(drawn[7 * epoch:7 * epoch + 7])) == 7  # each epoch: every training line once
    assert drawn[:7] != drawn[7:14]  # each epoch in its own order
    again = JsonlPrompts(data, seed=0, num_eval=3, grade_reward=arithmetic_reward)
    assert [s.prompt for s in again.prompts(5, 4)] == [s.prompt for s in steps[5]]  # a pure function of the step
    other = JsonlPrompts(data, seed=1, num_eval=3, grade_reward=arithmetic_reward)
    assert [s.prompt for s in other.prompts(0, 7)] != drawn[:7]
    sample = dataset.eval_set[0]
    assert dataset.grade(sample, f" {sample.meta['answer']}") == 1.0 and dataset.grade(sample, " x") == 0.0


def test_builtin_task_is_a_dataset_too():
    dataset = prompt_dataset("builtin:arithmetic", seed=0, num_eval=5, task_levels=[1], rewards=["format"])
    assert isinstance(dataset, ArithmeticPrompts)
    sample = dataset.prompts(0, 1)[0]
    assert set(sample.meta) == {"answer"} and dataset.grade(sample, f" {sample.meta['answer']}") == 1.0


@pytest.mark.parametrize("text, num_eval, message", [
    ('{"prompt": "a"}\nnot json\n', 0, r'p.jsonl:2 is not a JSON object with a "prompt" string'),
    ('{"question": "a"}\n', 0, r'p.jsonl:1 is not a JSON object with a "prompt" string'),
    ('{"prompt": "a"}\n{"prompt": "b"}\n', 2, r"has 2 prompts and eval_prompts=2 would hold out all of them"),
])
def test_bad_jsonl_is_one_clear_error(tmp_path, text, num_eval, message):
    (tmp_path / "p.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message):
        prompt_dataset(str(tmp_path / "p.jsonl"), seed=0, num_eval=num_eval, task_levels=[1], rewards=["arithmetic"])


@pytest.mark.parametrize("data, message", [
    ("prompts.csv", "give 'builtin:arithmetic' or a .jsonl file"),
    ("missing.jsonl", "missing.jsonl': no such file"),
    ("builtin:text", "the built-in prompt dataset is 'builtin:arithmetic'"),
    ("prompts.jsonl", "needs --base"),  # exists: the built-in base cannot answer a user's prompts
])
def test_grpo_data_flag_fails_before_any_model(tmp_path, monkeypatch, capsys, data, message):
    monkeypatch.chdir(tmp_path)
    write_prompts(tmp_path / "prompts.jsonl", 4)
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--out-dir", str(tmp_path / "run"), "--data", data])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()


def test_resuming_on_other_data_says_so(tmp_path):
    """A run's --out-dir resumed with another --data: one message naming both, not DCP's missing-key traceback."""
    from seekforge.errors import UserError

    data = write_prompts(tmp_path / "prompts.jsonl", 12)
    builtin_run = small_config(tmp_path, steps=1, save_interval=1, out_dir=str(tmp_path / "builtin"))
    make_trainer(builtin_run).fit(progress=False)
    other = small_config(tmp_path, data=str(data), rewards=[f"{__name__}:column_reward"], eval_prompts=3, steps=2,
                         out_dir=str(tmp_path / "builtin"))
    with pytest.raises(UserError, match=r"trained on builtin:arithmetic, and this one asks for .*prompts.jsonl"):
        make_trainer(other).resume()

    jsonl_run = small_config(tmp_path, data=str(data), rewards=[f"{__name__}:column_reward"], eval_prompts=3,
                             steps=1, save_interval=1, out_dir=str(tmp_path / "jsonl"))
    make_trainer(jsonl_run).fit(progress=False)
    with pytest.raises(UserError, match=r"trained on .*prompts.jsonl, and this one asks for builtin:arithmetic"):
        make_trainer(small_config(tmp_path, steps=2, out_dir=str(tmp_path / "jsonl"))).resume()
