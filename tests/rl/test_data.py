"""Prompt datasets (rl/data.py): a JSONL file of prompts trains like the built-in task, its other columns
reach the rewards, its order is a pure function of the seed and the step (so a resumed run draws what the
uninterrupted one drew), its held-out lines are never trained on, and bad files fail with one message.
Parquet files, `datasets` directories and hub names give the same rows; chat prompts go through the
tokenizer's chat template; held-out prompts may come from a source of their own."""

from __future__ import annotations

import json

import pytest

from seekforge.cli import main
from seekforge.rl.data import ArithmeticPrompts, TablePrompts, load_rows, prompt_dataset
from seekforge.rl.rewards import completion_text
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
    assert full[-1]["rewards/column_reward/mean"] == pytest.approx(full[-1]["reward_mean"])  # one reward, weight 1

    split = small_config(tmp_path, **common, out_dir=str(tmp_path / "split"))
    first = make_trainer(split).fit(stop_at=1, progress=False)
    resumed = make_trainer(split)
    assert resumed.resume() and resumed.step_count == resumed.prompt_stream.position == 1
    second = resumed.fit(progress=False)
    keys = ["reward_mean", "rewards/column_reward/mean", "rewards/column_reward/std", "loss", "clip_fraction",
            "response_length", "eval_accuracy"]
    for a, b in zip(full, first + second, strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}

    write_prompts(data, 13)  # another file under the same name: resuming on it would train on other prompts
    with pytest.raises(ValueError, match="another version of .*prompts.jsonl.*--no-resume"):
        make_trainer(split).resume()


def jsonl_dataset(path, seed: int, num_eval: int) -> TablePrompts:
    rows, fingerprint = load_rows(str(path))
    return TablePrompts(str(path), rows, fingerprint, seed, num_eval)


def test_jsonl_order_is_seeded_epochs_and_leaves_out_the_held_out_lines(tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 10)
    dataset = jsonl_dataset(data, seed=0, num_eval=3)
    held_out = {s.prompt for s in dataset.eval_set}
    steps = [dataset.prompts(step, 4) for step in range(7)]  # 28 prompts: four epochs of the 7 training lines
    drawn = [s.prompt for step in steps for s in step]
    assert len(held_out) == 3 and not held_out & set(drawn)
    for epoch in range(4):
        assert len(set(drawn[7 * epoch:7 * epoch + 7])) == 7  # each epoch: every training line once
    assert drawn[:7] != drawn[7:14]  # each epoch in its own order
    again = jsonl_dataset(data, seed=0, num_eval=3)
    assert [s.prompt for s in again.prompts(5, 4)] == [s.prompt for s in steps[5]]  # a pure function of the step
    other = jsonl_dataset(data, seed=1, num_eval=3)
    assert [s.prompt for s in other.prompts(0, 7)] != drawn[:7]
    assert dataset.grader is None  # the run's first reward grades a user's held-out prompts


def test_builtin_task_is_a_dataset_too():
    dataset = prompt_dataset("builtin:arithmetic", seed=0, num_eval=5, task_levels=[1])
    assert isinstance(dataset, ArithmeticPrompts) and dataset.grader == "arithmetic"
    sample = dataset.prompts(0, 1)[0]
    assert set(sample.meta) == {"answer"}
    with pytest.raises(ValueError, match="eval_data='x.jsonl' needs data other than 'builtin:arithmetic'"):
        prompt_dataset("builtin:arithmetic", seed=0, num_eval=5, task_levels=[1], eval_spec="x.jsonl")


def test_parquet_and_datasets_sources_give_the_jsonl_rows(tmp_path, monkeypatch):
    """The same rows from a Parquet file, a `datasets.save_to_disk` directory (a Dataset, and a DatasetDict's
    split) and an hf: name: the same samples, so the same training order."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in write_prompts(tmp_path / "p.jsonl", 6).read_text().splitlines()]
    for row in rows:  # chat prompts (a Parquet column holds one type: all of them)
        row["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["prompt"]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    expected = load_rows(str(tmp_path / "p.jsonl"))[0]
    assert expected[0].prompt == rows[0]["prompt"] and expected[1].meta == {"answer": "3", "level": 2}
    assert load_rows(str(tmp_path / "p.parquet"))[0] == expected
    pq.write_table(pa.Table.from_pylist([{"question": "a"}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet has no `prompt` column \(its columns: question\)"):
        load_rows(str(tmp_path / "bad.parquet"))

    datasets = pytest.importorskip("datasets", reason="the `datasets` sources need the datasets library")
    table = datasets.Dataset.from_list(rows)
    table.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": table, "test": table.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    assert load_rows(str(tmp_path / "one"))[0] == expected
    assert load_rows(str(tmp_path / "dict"))[0] == expected  # a DatasetDict's train split
    assert load_rows(f"{tmp_path / 'dict'}:test")[0] == expected[:2]
    with pytest.raises(ValueError, match=r"has the splits \['test', 'train'\], not 'dev'"):
        load_rows(f"{tmp_path / 'dict'}:dev")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or table)
    assert load_rows("hf:owner/name:main:test")[0] == expected and load_rows("hf:owner/name")[0] == expected
    assert calls == [(("owner/name", "main"), {"split": "test"}), (("owner/name", None), {"split": "train"})]


def test_without_datasets_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ValueError, match=r"data='hf:owner/name' needs the `datasets` library: pip install datasets"):
        load_rows("hf:owner/name")


def test_chat_prompts_are_rendered_by_the_chat_template_and_reach_the_rewards_as_messages(tmp_path):
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.rl.rollout import encode_prompt

    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Q: 2 + 3 = ?"}]
    rows = [{"prompt": chat, "answer": "5"}, *({"prompt": f"Q: {i} + 1 = ? A:", "answer": "1"} for i in range(3))]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = load_tokenizer("byte")
    assert tokenizer.decode(encode_prompt(tokenizer, chat)) == \
        "System: Answer with a number.\nUser: Q: 2 + 3 = ?\nAssistant:"  # the byte tokenizer's plain template
    SEEN_PROMPTS.clear()
    cfg = small_config(tmp_path, data=str(data), rewards=[f"{__name__}:chat_reward"], eval_prompts=0, steps=1,
                       prompts_per_step=4, group_size=2)
    make_trainer(cfg).fit(progress=False)
    assert [p for p, _ in SEEN_PROMPTS].count(str(chat)) == 2  # the messages, G = 2 completions
    assert all(isinstance(c, list) == (p == str(chat)) for p, c in SEEN_PROMPTS)

    class NoSystemTurns:  # a template that refuses a conversation fails when the data loads, naming it
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise RuntimeError("System role not supported")

    with pytest.raises(ValueError, match="chat template failed on the prompt .*Answer with a number.*System role"):
        prompt_dataset(str(data), seed=0, num_eval=0, task_levels=[1], tokenizer=NoSystemTurns())


SEEN_PROMPTS: list = []


def chat_reward(prompts, completions, **columns):
    SEEN_PROMPTS.extend((str(p), c) for p, c in zip(prompts, completions, strict=True))
    return [float(len(completion_text(c))) for c in completions]


def test_eval_data_of_its_own_holds_out_no_training_rows(tmp_path):
    train = write_prompts(tmp_path / "train.jsonl", 5)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"H{i}", "answer": "1"}) + "\n" for i in range(6)))
    dataset = prompt_dataset(str(train), seed=0, num_eval=4, task_levels=[1], eval_spec=str(held))
    assert len(dataset.eval_set) == 4 and all(s.prompt.startswith("H") for s in dataset.eval_set)
    assert len({s.prompt for s in dataset.prompts(0, 5)}) == 5  # every training row trains
    everything = prompt_dataset(str(train), seed=0, num_eval=10, task_levels=[1], eval_spec=str(held))
    assert len(everything.eval_set) == 6


@pytest.mark.parametrize("text, num_eval, message", [
    ('{"prompt": "a"}\nnot json\n', 0, r'p.jsonl:2 is not a JSON object'),
    ('{"question": "a"}\n', 0, r'p.jsonl:1: "prompt" must be text or a non-empty list of'),
    ('{"prompt": [{"role": "user"}]}\n', 0, r'p.jsonl:1: "prompt" must be text or a non-empty list of'),
    ('{"prompt": "a"}\n{"prompt": "b"}\n', 2, r"has 2 prompts and eval_prompts=2 would hold out all of them"),
])
def test_bad_jsonl_is_one_clear_error(tmp_path, text, num_eval, message):
    (tmp_path / "p.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message):
        prompt_dataset(str(tmp_path / "p.jsonl"), seed=0, num_eval=num_eval, task_levels=[1])


@pytest.mark.parametrize("data, message", [
    ("prompts.csv", "give 'builtin:arithmetic', a .jsonl or .parquet file"),
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
