import pytest

from seekforge.model.model import build_model
from seekforge.train.trainer import Trainer, prepare_model

from .conftest import tiny_train_config


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_training(tmp_path, make_loader, recompute):
    """Recompute replays the forward in backward; it must not change the math, and the replayed MoE
    forwards must not be counted again in the expert loads that drive the bias update."""
    curves = {}
    for mode in ("none", recompute):
        cfg = tiny_train_config(tmp_path / mode, steps=3, recompute=mode)
        model = prepare_model(build_model(cfg.model_config(), seed=0), cfg)
        curves[mode] = Trainer(cfg, model, make_loader(cfg)).fit()
    for a, b in zip(curves["none"], curves[recompute], strict=True):
        assert a["expert_imbalance"] == b["expert_imbalance"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
