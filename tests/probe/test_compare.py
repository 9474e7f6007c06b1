"""probe/compare.py and report.py: a planted one-layer bug is located; seekforge and transformers
dumps of the same weights agree everywhere under the shipped mapping, forward and backward."""

import copy
import csv
import dataclasses
import math
import re

import pytest
import torch

from seekforge.model.hf import save_hf
from seekforge.probe.compare import compare_dumps, load_dump, load_mapping, map_name, tensor_metrics, write_csv
from seekforge.probe.config import DumpConfig
from seekforge.probe.dump import Dumper
from seekforge.probe.report import render_html


def dump(model, out_dir, ids, weights, logits=lambda out: out):
    with Dumper(model, DumpConfig(mode="tensor", out_dir=str(out_dir))).step(0):
        (logits(model(ids)) * weights).sum().backward()
    return load_dump(out_dir)


def test_tensor_metrics_against_hand_computed():
    b = torch.tensor([1.0, 2.0, -4.0, 1000.0])
    a = b + torch.tensor([0.0, 0.004, 0.0, 2.0])  # relative errors 0, 2e-3, 0, 2e-3
    m = tensor_metrics(a, b)
    assert m["max_abs_err"] == pytest.approx(2.0) and m["max_rel_err"] == pytest.approx(2e-3)
    assert m["within_1e-3"] == 0.5 and m["within_5e-3"] == 1.0
    expected = float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()))
    assert m["cosine"] == pytest.approx(expected, abs=1e-15)
    assert tensor_metrics(torch.zeros(3), torch.zeros(3))["cosine"] == 1.0
    assert math.isnan(tensor_metrics(torch.tensor([float("nan")]), torch.ones(1))["cosine"])


def softmax_scale_bug(model):
    model.layers[1].self_attn.softmax_scale *= 1.25


def rope_interleave_bug(model):
    attn = model.layers[1].self_attn
    attn.cfg = dataclasses.replace(attn.cfg, rope_interleave=not attn.cfg.rope_interleave)


@pytest.mark.parametrize("plant", [softmax_scale_bug, rope_interleave_bug])
def test_planted_bug_is_found_and_marked(tmp_path, tiny_model, batch, plant):
    buggy = copy.deepcopy(tiny_model)
    plant(buggy)
    reference = dump(tiny_model, tmp_path / "good", *batch)
    comparison = compare_dumps(dump(buggy, tmp_path / "bad", *batch), reference)
    assert not comparison.passed
    assert comparison.first_divergence == {"order": comparison.first_divergence["order"], "direction": "forward",
                                           "module": "layers.1.self_attn", "call": 0}
    # The first failing call is o_proj, whose input comes from the attention math: the blame moves up
    # to the attention module. Everything outside it that ran before agrees exactly.
    failing = [r for r in comparison.rows if r["status"] == "fail"]
    assert failing[0]["module"] == "layers.1.self_attn.o_proj" and failing[0]["slot"] == "input.0"
    first = comparison.first_divergence["order"]
    before = [r for r in comparison.rows if r["order"] < first and r["direction"] == "forward"
              and r["status"] != "skip" and not r["module"].startswith("layers.1.self_attn.o_proj")]
    assert before and all(r["status"] == "pass" and r["max_abs_err"] == 0 for r in before)
    page = render_html(comparison)
    assert len(re.findall(r'class="[^"]*first-diverging', page)) == 1  # one marked node
    assert '<details class="node fail first-diverging" data-module="layers.1.self_attn" id="first-divergence">' in page
    assert "first divergence (forward, call 0)" in page


def test_identical_runs_pass_and_csv(tmp_path, tiny_model, batch):
    comparison = compare_dumps(dump(tiny_model, tmp_path / "a", *batch), dump(tiny_model, tmp_path / "b", *batch))
    assert comparison.passed and comparison.first_divergence is None
    rows = list(csv.DictReader(open(write_csv(comparison, tmp_path / "c.csv"))))
    assert len(rows) == len(comparison.rows) and {r["status"] for r in rows} == {"pass"}
    assert float(rows[0]["cosine"]) == pytest.approx(1.0)


def test_seekforge_matches_transformers_forward_and_backward(tmp_path, tiny_model, batch):
    transformers = pytest.importorskip("transformers")
    save_hf(tiny_model, tmp_path / "hf")
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager").eval()
    ours = dump(tiny_model, tmp_path / "seekforge", *batch)
    theirs = dump(reference, tmp_path / "transformers", *batch, logits=lambda out: out.logits)
    comparison = compare_dumps(ours, theirs, load_mapping("transformers_deepseek_v3"))
    assert comparison.passed, [r for r in comparison.rows if r["status"] == "fail"][:3]
    compared = [r for r in comparison.rows if r["status"] == "pass"]
    for direction in ("forward", "backward"):
        modules = {r["module"] for r in compared if r["direction"] == direction}
        # every block, attention, MoE (its router too), norm and the head, in both directions
        for name in ("embed_tokens", "layers.0", "layers.2.self_attn", "layers.1.mlp", "layers.1.mlp.gate",
                     "layers.2.mlp.shared_experts", "norm", "lm_head"):
            assert name in modules, (direction, name)
    assert min(r["cosine"] for r in compared) > 1 - 1e-6
    assert all(r["status"] == "skip" for r in comparison.rows if r["module"] in ("rotary", "layers.1.mlp.experts"))


def test_mapping_rules_and_errors(tmp_path):
    rules = load_mapping("transformers_deepseek_v3")
    assert map_name(rules, "layers.3.self_attn.kv_b_proj")[0] == "model.layers.3.self_attn.kv_b_proj"
    assert map_name(rules, "lm_head")[0] == "lm_head"
    assert map_name(rules, "rotary")[0] is None and "cos/sin" in map_name(rules, "rotary")[1].skip
    with pytest.raises(ValueError, match="shipped"):
        load_mapping("no_such_mapping")
    (tmp_path / "m.yaml").write_text("rules:\n  - {pattern: 'a', replace: 'b', skip: 'why'}\n")
    with pytest.raises(ValueError, match="exactly one"):
        load_mapping(tmp_path / "m.yaml")
