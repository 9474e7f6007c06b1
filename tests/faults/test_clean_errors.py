"""Failures a user's files or settings cause end in one line naming the file or value and the fix
(exit 2, no traceback); a bug inside a library still shows its traceback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from seekforge.cli import is_user_error, main
from seekforge.config import preset
from seekforge.model.hf import save_hf
from seekforge.model.model import build_model
from seekforge.model.tokenizer import ByteTokenizer

from .conftest import truncate


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf(build_model(preset("tiny"), seed=0), path)
    ByteTokenizer().save(path)
    return path


def _bigger_tokenizer(path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0")).save(str(path / "tokenizer.json"))


def _config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


BREAK = {
    "truncated shard": (lambda p: truncate(p / "model.safetensors"), "model.safetensors", "truncated or corrupt"),
    "garbage header": (lambda p: (p / "model.safetensors").write_bytes(  # the 8-byte header length, and more
        b"\xff" * 16 + (p / "model.safetensors").read_bytes()[16:]), "model.safetensors", "re-download"),
    "config.json not json": (lambda p: (p / "config.json").write_text("{oops"), "config.json", "not valid JSON"),
    "config disagrees with weights": (lambda p: _config(p, hidden_size=128), "config.json",
                                      "disagree"),
    "wrong tokenizer": (_bigger_tokenizer, "tokenizer.json", "has 1000 tokens but the model"),
}


@pytest.mark.parametrize("name", list(BREAK))
def test_broken_model_files_give_one_line(hf_dir, tmp_path, capsys, name):
    damage, names, says = BREAK[name]
    path = tmp_path / "model"
    shutil.copytree(hf_dir, path)
    damage(path)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(path), "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("seekforge generate: error:")]
    assert info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert names in lines[0] and says in lines[0], lines[0]


def test_a_model_too_big_for_the_machine_fails_before_allocating(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["pretrain", "--preset", "v3-671b", "--steps", "1", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "GiB per rank" in err and "Traceback" not in err, err


def test_a_library_value_error_is_a_bug_not_a_user_error():
    try:
        torch.nn.functional.cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    except ValueError as e:
        assert not is_user_error(e)  # the CLI re-raises it: the traceback is kept
    try:
        raise ValueError("tp=3 does not divide num_attention_heads=16; pick tp in {1,2,4,8,16}")
    except ValueError as e:
        assert not is_user_error(e)  # raised in a test module, not in seekforge
    from seekforge.errors import UserError

    assert is_user_error(UserError("x"))
