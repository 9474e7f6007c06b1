"""probe/dump.py: which calls are recorded and in what order, and that the recorded statistics,
hashes and tensors are the values the modules actually saw."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from seekforge.probe.config import DumpConfig, load_probe_config
from seekforge.probe.dump import Dumper, materialize, tensor_summary


class Twice(nn.Module):
    """Calls one submodule twice, and returns a tuple: repeated-call numbering and nested slots."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x, scale=1.0):
        h = self.inner(self.inner(x) * scale)
        return self.head(h), (h, h.sum())


def records(path):
    return [json.loads(line) for line in (path / "step0" / "rank0" / "records.jsonl").read_text().splitlines()]


def test_call_order_repeats_and_slots(tmp_path):
    model = nn.Sequential(Twice())
    x = torch.randn(3, 4, requires_grad=True)
    dumper = Dumper(model, DumpConfig(out_dir=str(tmp_path)))
    with dumper.step(0):
        out, (h, total) = model(x)
        (out.sum() + total).backward()
    recs = records(tmp_path)
    forward = [(r["module"], r["call"]) for r in recs if r["direction"] == "forward"]
    # Completion order: each inner call returns before its parent; the parent comes last.
    assert forward == [("0.inner", 0), ("0.inner", 1), ("0.head", 0), ("0", 0)]
    assert [r["order"] for r in recs] == list(range(len(recs)))
    backward = [(r["module"], r["call"]) for r in recs if r["direction"] == "backward"]
    assert backward[-1] == ("0", 0) and ("0.inner", 1) in backward and ("0.inner", 0) in backward
    parent = next(r for r in recs if r["module"] == "0" and r["direction"] == "forward")
    assert set(parent["tensors"]) == {"input.0", "output.0", "output.1.0", "output.1.1"}
    classes = json.loads((tmp_path / "step0" / "rank0" / "modules.json").read_text())
    assert classes == {"0": "Twice", "0.inner": "Linear", "0.head": "Linear"}


def test_statistics_match_torch(tmp_path):
    x = torch.randn(5, 7, dtype=torch.float64)
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), float("-inf"), float("nan")
    stats = materialize(tensor_summary(x, with_md5=True))
    finite = x[x.isfinite()]
    assert stats["nan"] == 1 and stats["inf"] == 2 and stats["shape"] == [5, 7] and stats["dtype"] == "float64"
    assert stats["md5"] == hashlib.md5(x.numpy().tobytes()).hexdigest()
    y = torch.randn(64, 33)
    stats = materialize(tensor_summary(y))
    for name, expected in [("max", y.max()), ("min", y.min()), ("mean", y.mean()), ("norm", y.norm())]:
        assert stats[name] == pytest.approx(float(expected), rel=1e-6, abs=1e-7), name
    assert finite.numel() == 32
    bf16 = materialize(tensor_summary(y.bfloat16()))
    assert bf16["dtype"] == "bfloat16" and bf16["norm"] == pytest.approx(float(y.bfloat16().float().norm()), rel=1e-5)


def test_tensor_mode_keeps_the_exact_values(tmp_path, tiny_model, batch):
    ids, weights = batch
    seen = {}
    handle = tiny_model.layers[1].self_attn.register_forward_hook(lambda m, a, out: seen.update(out=out.detach()))
    dumper = Dumper(tiny_model, DumpConfig(mode="tensor", modules=["re:layers\\.1\\.self_attn(\\.o_proj)?"],
                                           out_dir=str(tmp_path)))
    with dumper.step(0):
        (tiny_model(ids) * weights).sum().backward()
    handle.remove()
    recs = records(tmp_path)
    assert {r["module"] for r in recs} == {"layers.1.self_attn", "layers.1.self_attn.o_proj"}
    tensors = load_file(tmp_path / "step0" / "rank0" / "tensors.safetensors")
    assert torch.equal(tensors["forward/layers.1.self_attn/0/output.0"], seen["out"])
    assert "backward/layers.1.self_attn/0/grad_output.0" in tensors
    assert not any(h for h in dumper.handles)  # hooks gone after the step


def test_selection_by_step_rank_direction_and_slot(tmp_path, tiny_model, batch):
    ids, _ = batch
    cfg = DumpConfig(modules=["layers.*.mlp"], steps=[1], directions=["forward"], slots=["output"],
                     out_dir=str(tmp_path))
    dumper = Dumper(tiny_model, cfg, rank=0)
    for step in range(3):
        with dumper.step(step):
            tiny_model(ids)
    assert [p.name for p in tmp_path.iterdir()] == ["step1"]
    recs = [json.loads(line) for line in (tmp_path / "step1/rank0/records.jsonl").read_text().splitlines()]
    assert [r["module"] for r in recs] == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]
    assert all(set(r["tensors"]) == {"output.0"} and r["direction"] == "forward" for r in recs)
    assert not Dumper(tiny_model, DumpConfig(ranks=[1]), rank=0).selected(0)


def test_bad_config_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        DumpConfig(mode="everything")
    with pytest.raises(ValueError, match="re:"):
        DumpConfig(modules=["re:layers.(("])
    (tmp_path / "probe.yaml").write_text("dump: {mode: tensor, stepz: [1]}\n")
    with pytest.raises(ValueError, match="stepz"):
        load_probe_config(tmp_path / "probe.yaml")
    (tmp_path / "probe.yaml").write_text("dump: {mode: tensor\n")
    with pytest.raises(ValueError, match="probe.yaml does not parse"):
        load_probe_config(tmp_path / "probe.yaml")
    with pytest.raises(ValueError, match="does not exist"):
        load_probe_config(tmp_path / "absent.yaml")


def test_activation_recompute_replays_are_not_new_calls(tmp_path):
    """Checkpointed blocks run their forward again inside backward; those replays are not recorded."""
    from torch.utils.checkpoint import checkpoint

    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    outer = nn.ModuleDict({"block": inner})
    x = torch.randn(2, 4, requires_grad=True)
    with Dumper(outer, DumpConfig(out_dir=str(tmp_path))).step(0):
        checkpoint(outer["block"], x, use_reentrant=False).sum().backward()
    forward = [(r["module"], r["call"]) for r in records(tmp_path) if r["direction"] == "forward"]
    assert forward == [("block.0", 0), ("block.1", 0), ("block.2", 0), ("block", 0)]
