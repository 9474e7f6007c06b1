"""probe/monitor.py inside the real Trainer: its numbers against direct computation, and the anomaly
rules on a planted NaN and a planted gradient spike, each leaving a dump of that step."""

import json

import torch

from seekforge.probe.compare import load_dump
from seekforge.train.trainer import Trainer
from tests.train.conftest import PatternDataset, StandInLoader, tiny_train_config


def make_trainer(tmp_path, monitor_yaml: str, **overrides):
    probe = tmp_path / "probe.yaml"
    probe.write_text(monitor_yaml)
    cfg = tiny_train_config(tmp_path, dtype="fp32", probe=str(probe), **overrides)
    torch.manual_seed(0)
    from seekforge.model.model import build_model

    model = build_model(cfg.model_config(), seed=0)
    loader = StandInLoader(PatternDataset(cfg.model_config().vocab_size, cfg.seq_len, 64), cfg.micro_batch_size)
    return Trainer(cfg, model, loader, out_dir=tmp_path / "run")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_monitor_numbers_match_direct_computation(tmp_path):
    trainer = make_trainer(tmp_path, "monitor: {modules: ['re:layers\\.\\d+', lm_head], interval: 2}\n")
    layer = trainer.model.layers[1]
    for _ in range(2):
        before = [p.detach().clone() for p in layer.parameters()]
        trainer.train_step()
    (row,) = read_jsonl(tmp_path / "run/probe/monitor_rank0.jsonl")  # step 2 only: interval 2
    entry = row["modules"]["layers.1"]
    update = torch.stack([(p.detach() - b).norm() for p, b in zip(layer.parameters(), before, strict=True)]).norm()
    weight = torch.stack([b.norm() for b in before]).norm()
    assert abs(entry["update_ratio"] - float(update / weight)) < 1e-5 * float(update / weight)
    state = [trainer.optimizers[0].state[p] for p in layer.parameters()]
    exp_avg = torch.stack([s["exp_avg"].norm() for s in state]).norm()
    assert abs(entry["exp_avg_norm"] - float(exp_avg)) < 1e-5 * float(exp_avg)
    assert entry["activation_norm"] > 0 and entry["output_grad_norm"] > 0 and entry["weight_grad_norm"] > 0
    cfg = trainer.cfg
    tokens = cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum * trainer.model.cfg.num_experts_per_tok
    assert row["expert_load"] and all(sum(load) == tokens for load in row["expert_load"].values())
    assert row["step"] == 2 and row["grad_norm"] > 0
    assert "lm_head" in row["modules"]


def test_planted_nan_alerts_and_dumps_that_step(tmp_path):
    trainer = make_trainer(tmp_path, "monitor: {min_history: 2}\n")
    for _ in range(3):
        trainer.train_step()
    poison = trainer.model.layers[1].register_forward_hook(lambda m, args, out: out * float("nan"))
    metrics = trainer.train_step()
    poison.remove()
    assert metrics["probe_alerts"] == 1
    (alert,) = read_jsonl(tmp_path / "run/probe/alerts_rank0.jsonl")
    assert alert["step"] == 4 and alert["rule"] == "nan_inf"
    assert alert["detail"] == "first non-finite: layers.1 (forward)"  # layer 0 before it is clean
    dump = load_dump(alert["dump"])
    assert dump.path.parts[-2:] == ("step4", "rank0")
    by_module = {(r["module"], r["direction"]): r for r in dump.records}
    assert by_module[("layers.0", "forward")]["tensors"]["output.0"]["nan"] == 0
    assert by_module[("layers.1", "forward")]["tensors"]["output.0"]["nan"] > 0


def test_planted_grad_spike_alerts_once(tmp_path):
    trainer = make_trainer(tmp_path, "monitor: {min_history: 2, grad_spike_factor: 10}\n", steps=8)
    norms = []
    for step in range(1, 7):
        spike = None
        if step == 5:  # every gradient below layer 1 scaled ×1000
            spike = trainer.model.layers[1].register_full_backward_pre_hook(
                lambda m, grad_out: tuple(g * 1000 for g in grad_out))
        norms.append(trainer.train_step()["grad_norm"])
        if spike:
            spike.remove()
    alerts = read_jsonl(tmp_path / "run/probe/alerts_rank0.jsonl")
    assert [(a["step"], a["rule"]) for a in alerts] == [(5, "grad_spike")], norms
    assert (tmp_path / "run/probe/anomaly_dumps/step5/rank0/records.jsonl").exists()
