"""Recipes resolve to modules by llm-compressor's rules, and every bad recipe fails before a weight moves."""

import json
import subprocess
import sys

import pytest
import torch

from seekforge.quant.calibrate import quantize_model
from seekforge.quant.data import calibration_samples
from seekforge.quant.recipe import Recipe, resolve
from seekforge.quant.schemes import W8A16


def test_targets_and_ignore_patterns(tiny):
    plan = resolve(tiny, Recipe(scheme="w4a16", group_size=32, ignore=["lm_head", "re:.*self_attn\\.o_proj$",
                                                                       "*.shared_experts.*"]))
    assert "lm_head" not in plan and "model.layers.0.self_attn.o_proj" not in plan
    assert not any("shared_experts" in n for n in plan)
    assert "model.layers.0.self_attn.q_a_proj" in plan and "model.layers.1.mlp.experts.7.down_proj" in plan
    assert not any(n.startswith("model.layers.3.") for n in plan)  # the MTP layer
    only = resolve(tiny, Recipe(scheme="w4a16", group_size=32, targets=["re:.*experts\\.\\d+\\..*"]))
    assert only and all(".experts." in n for n in only)


def test_kv_b_proj_stays_weight_only_under_w8a8(tiny):
    plan = resolve(tiny, Recipe(scheme="w8a8-dynamic"))
    assert plan["model.layers.0.self_attn.kv_b_proj"] is W8A16
    assert plan["model.layers.0.self_attn.q_a_proj"].input_activations is not None


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheme="w4a16", group_size=32, targets=["model.layers.0.self_attn.nonexistent"]), "matches no linear"),
    (dict(scheme="w4a16", group_size=32, ignore=["re:.*not_a_module$"]), "matches no module"),
    (dict(scheme="w4a16"), "group_size=128 does not divide"),
    (dict(scheme="w4a16", group_size=32, ignore=["model.layers.1.mlp.experts.3.up_proj"]), "only some of"),
])
def test_bad_recipe_fails_before_any_weight_moves(tiny_copy, samples, kwargs, message):
    before = {k: v.clone() for k, v in tiny_copy.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        quantize_model(tiny_copy, Recipe(**kwargs), samples, progress=False)
    after = tiny_copy.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheme="w3a16"), "unsupported scheme"),
    (dict(scheme="w4a16", method="hqq"), "unsupported method"),
    (dict(scheme="w8a8-dynamic", method="awq"), "weight-only rounding"),
    (dict(scheme="w4a16", smoothing_strength=0.5), "quantizes weights only"),
])
def test_unsupported_recipe_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**kwargs)


def test_calibration_data_that_does_not_tokenize(tmp_path, tiny):
    from seekforge.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("byte")
    bad = tmp_path / "bad.jsonl"
    for lines, message in ((['{"txt": "x"}'], "not a JSON object"), (['{"text": ""}'], "tokenizes to 0"),
                           (["not json"], "not a JSON object")):
        bad.write_text("\n".join(lines))
        with pytest.raises(ValueError, match=message):
            calibration_samples(str(bad), tokenizer, tiny.cfg.vocab_size, 4, 64)

    class WrongTokenizer:  # ids beyond the model's vocabulary: another model's tokenizer
        def encode(self, text):
            return [10_000] * 4

    bad.write_text(json.dumps({"text": "hello"}))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        calibration_samples(str(bad), WrongTokenizer(), tiny.cfg.vocab_size, 4, 64)


@pytest.mark.parametrize("recipe_text, message", [
    ("scheme: w4a16\ngroup_size: 32\ntargets: ['re:.*no_such_proj$']\n", "matches no linear module"),
    ("scheme: w3a16\n", "unsupported scheme"),
    ("scheme: w8a8-static\nnum_calibration_samples: 2\ndataset: DATA\n", "tokenizes to 0"),
    ("scheme: w4a16\ngroup_size: 0\n", "group_size=0: give a positive integer"),
    ("scheme: w4a16\ntargets: [Linear\n", "does not parse"),
])
def test_cli_bad_recipe_is_one_message_and_writes_nothing(tmp_path, recipe_text, message):
    """The three ways a recipe goes wrong (a module that does not exist, a scheme we do not have,
    calibration data that does not tokenize) end `seekforge quantize` with one line and no output."""
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": ""}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text.replace("DATA", str(data)))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "seekforge", "quantize", "--model", "tiny", "--recipe", str(recipe),
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr
    assert not out.exists()


def test_cli_refuses_a_missing_recipe_and_an_output_over_a_full_precision_checkpoint(tmp_path):
    """The output replaces its directory whole: over the model's own checkpoint (or another full-precision one) it
    would lose it, so that is refused before anything is loaded."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text('{"model_type": "deepseek_v3"}')
    for how, message in ((["--scheme", "w8a8-dynamic", "--out", str(full)], "not quantized"),
                         (["--recipe", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "q")], "does not exist")):
        result = subprocess.run([sys.executable, "-m", "seekforge", "quantize", "--model", "tiny", *how],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    assert [p.name for p in full.iterdir()] == ["config.json"]
