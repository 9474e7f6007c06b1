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


def test_overlap_gives_the_same_training_on_one_process(tmp_path, make_loader):
    """TrainConfig.overlap runs each micro-batch's forward beside the previous one's backward (parallel/overlap.py):
    on one process too, the same losses and grad norms bit for bit (tests/dist/test_ep_overlap.py: under ep=2)."""
    curves = {}
    for overlap in (False, True):
        cfg = tiny_train_config(tmp_path / str(overlap), steps=3, grad_accum=3, dtype="fp32", overlap=overlap)
        model = prepare_model(build_model(cfg.model_config(), seed=0), cfg)
        curves[overlap] = Trainer(cfg, model, make_loader(cfg)).fit()
    for a, b in zip(curves[False], curves[True], strict=True):
        assert (a["loss"], a["grad_norm"], a["expert_imbalance"]) == (b["loss"], b["grad_norm"], b["expert_imbalance"])


def test_overlap_refuses_bf16_master_weights(tmp_path, make_loader):
    cfg = tiny_train_config(tmp_path, dtype="bf16", overlap=True)
    with pytest.raises(ValueError, match="overlap=True with bf16 on one process"):
        Trainer(cfg, build_model(cfg.model_config(), seed=0), make_loader(cfg))
