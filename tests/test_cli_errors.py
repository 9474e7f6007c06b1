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
