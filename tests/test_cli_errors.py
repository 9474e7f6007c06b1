"""Bad command lines end in one line naming the flag and the fix (exit 2), before any model loads."""

from __future__ import annotations

import pytest

from seekforge.cli import main


@pytest.mark.parametrize("argv, says", [
    (["bench", "serve", "--request-rate", "0"], "--request-rate 0.0: give requests/s > 0"),
    (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency 0: give at least 1"),
    (["serve", "--max-n", "0"], "--max-n 0: give at least 1"),
    (["serve", "--model", "/nonexistent/model"], "neither a preset"),
    (["serve", "--lora-modules", "adapter"], "write NAME=PATH"),
    # generate checks its sampling flags with SamplingParams' own checker (model/generate.check_sampling)
    (["generate", "--temperature", "1", "--top-p", "0"], "--top-p=0.0: must be in (0, 1]"),
    (["generate", "--temperature", "1", "--top-p", "1.5"], "--top-p=1.5: must be in (0, 1]"),
    (["generate", "--temperature", "-1"], "--temperature=-1.0: must be a finite number >= 0 (0 is greedy)"),
    (["generate", "--temperature", "nan"], "--temperature=nan: must be a finite number >= 0"),
    (["generate", "--top-k", "-3"], "--top-k=-3: must be an integer >= 1, or 0 / -1 for off"),
    (["pretrain", "--preset", "tiny", "--lr", "-0.001"], "TrainConfig.lr=-0.001: must be > 0"),
    (["grpo", "--base", "/nonexistent/model", "--set", "steps=1"], "--base '/nonexistent/model'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_flags_are_one_line(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
