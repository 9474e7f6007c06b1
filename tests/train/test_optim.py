import math

import pytest

from seekforge.config import TrainConfig
from seekforge.model.model import build_model
from seekforge.train.optim import build_optimizer, lr_schedule, param_groups

KW = dict(lr=1.0, min_lr=0.1, warmup=10, steps=110)


def test_warmup_is_linear_from_lr_over_warmup():
    assert lr_schedule(0, **KW) == pytest.approx(0.1)
    assert lr_schedule(4, **KW) == pytest.approx(0.5)
    assert lr_schedule(9, **KW) == pytest.approx(1.0)


def test_cosine_key_steps():
    assert lr_schedule(10, **KW) == pytest.approx(1.0)  # first post-warmup step: the peak
    mid = 10 + (109 - 10) / 2
    assert lr_schedule(int(mid), **KW) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * int(mid - 10) / 99)))
    assert lr_schedule(109, **KW) == pytest.approx(0.1)  # last step lands on min_lr
    values = [lr_schedule(s, **KW) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # monotone decay


def test_wsd_key_steps():
    kw = dict(KW, schedule="wsd", decay_fraction=0.2)  # decay over the last 22 steps: 88..109
    assert lr_schedule(9, **kw) == pytest.approx(1.0)
    assert lr_schedule(50, **kw) == pytest.approx(1.0)  # stable
    assert lr_schedule(87, **kw) == pytest.approx(1.0)  # last stable step
    assert lr_schedule(88, **kw) == pytest.approx(1.0 - 0.9 / 22)  # first decay step
    assert lr_schedule(109, **kw) == pytest.approx(0.1)


def test_unknown_schedule_is_a_value_error():
    with pytest.raises(ValueError, match="'cosine' or 'wsd'"):
        lr_schedule(20, **KW, schedule="linear")


def test_scheduler_drives_optimizer_lr():
    cfg = TrainConfig(preset="tiny", lr=1e-3, min_lr=1e-4, warmup=2, steps=6)
    model = build_model(cfg.model_config())
    optimizer, scheduler = build_optimizer(model, cfg.optimizer_config())
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_schedule(s, lr=1e-3, min_lr=1e-4, warmup=2, steps=6) for s in range(6)])


def test_no_weight_decay_on_1d_params():
    model = build_model(TrainConfig(preset="tiny").model_config())
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert no_decay_names and all(p.ndim == 1 for p in no_decay["params"])
    assert "norm.weight" in no_decay_names and "layers.0.input_layernorm.weight" in no_decay_names
    assert all(p.ndim >= 2 for p in decay["params"])  # matrices, stacked experts, embeddings
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(
        p.numel() for p in model.parameters())
