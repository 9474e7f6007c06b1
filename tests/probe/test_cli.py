"""`seekforge probe`: the four modes from the command line, end to end."""

import pytest

from seekforge.cli import main
from seekforge.config import preset
from seekforge.model.hf import save_hf
from seekforge.model.model import build_model


def test_help_explains_every_mode(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    text = capsys.readouterr().out
    for mode in ("dump:", "compare:", "report:", "trace:"):
        assert mode in text
    with pytest.raises(SystemExit):
        main(["probe", "compare", "--help"])
    assert "first diverging module" in capsys.readouterr().out


def test_dump_transformers_and_seekforge_then_compare_and_report(tmp_path, capsys):
    pytest.importorskip("transformers")
    # The tiny preset (4 heads): its export must say num_key_value_heads=4, or transformers' eager
    # MLA repeats the keys 4 // 128 = 0 times.
    save_hf(build_model(preset("tiny"), seed=0), tmp_path / "hf")
    for impl in ("seekforge", "transformers"):
        main(["probe", "dump", "--model", str(tmp_path / "hf"), "--impl", impl, "--out", str(tmp_path / impl)])
    main(["probe", "compare", str(tmp_path / "seekforge"), str(tmp_path / "transformers"), "--mapping",
          "transformers_deepseek_v3", "--csv", str(tmp_path / "c.csv"), "--html", str(tmp_path / "c.html")])
    out = capsys.readouterr().out
    assert " 0 fail" in out and (tmp_path / "c.csv").exists() and (tmp_path / "c.html").exists()
    # Without the mapping only `lm_head` (the same name in both) lines up; the rest is skipped.
    main(["probe", "report", str(tmp_path / "seekforge"), str(tmp_path / "transformers"),
          "--html", str(tmp_path / "r.html")])
    assert "4 pass, 0 fail" in capsys.readouterr().out and (tmp_path / "r.html").exists()


def test_compare_fails_with_exit_code_1(tmp_path, capsys):
    main(["probe", "dump", "--model", "tiny", "--out", str(tmp_path / "a"), "--seed", "0"])
    main(["probe", "dump", "--model", "tiny", "--out", str(tmp_path / "b"), "--seed", "1"])
    with pytest.raises(SystemExit) as exit_info:
        main(["probe", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--csv", str(tmp_path / "c.csv")])
    assert exit_info.value.code == 1 and "first divergence: embed_tokens" in capsys.readouterr().out


def test_trace_trigger_file(tmp_path, capsys):
    main(["probe", "trace", "--run-dir", str(tmp_path), "--steps", "4"])
    assert (tmp_path / "probe" / "trace_request").read_text() == "4\n"
    with pytest.raises(SystemExit) as exit_info:  # bad input: one clean error, exit 2
        main(["probe", "trace", "--run-dir", str(tmp_path), "--steps", "0"])
    assert exit_info.value.code == 2 and "at least one" in capsys.readouterr().err
