"""bf16 compute weights over fp32 masters (train/master.py) against the path they replace: bf16 autocast
over the fp32 parameters. The claim is bitwise equality, so the tolerance is zero."""

import pytest
import torch
from torch import nn

from seekforge.model.model import build_model
from seekforge.model.moe import GroupedExperts
from seekforge.train.master import MasterWeights, matmul_parameters
from seekforge.train.trainer import Trainer

from .conftest import tiny_train_config


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_master_weights_train_exactly_as_autocast(tmp_path, make_loader, grad_accum):
    """Same losses, grad norms, weights and optimizer states after 3 steps (MTP on, aux loss on); the
    reference is the same Trainer with autocast over fp32 parameters (master_weights switched off)."""
    runs = {}
    for name in ("autocast", "master"):
        cfg = tiny_train_config(tmp_path / name, steps=3, grad_accum=grad_accum, dtype="bf16")
        trainer = Trainer(cfg, build_model(cfg.model_config(), seed=0), make_loader(cfg))
        assert trainer.master_weights is not None
        if name == "autocast":
            trainer.master_weights = None
        runs[name] = (trainer, trainer.fit())
    (ref, ref_curve), (ours, curve) = runs["autocast"], runs["master"]
    for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
        assert [m[key] for m in curve] == [m[key] for m in ref_curve], key
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters(), strict=True):
        assert q.dtype == p.dtype == torch.float32 and torch.equal(p, q), name
    ref_state, state = ref.optimizers[0].state_dict()["state"], ours.optimizers[0].state_dict()["state"]
    for i, s in ref_state.items():
        assert torch.equal(s["exp_avg"], state[i]["exp_avg"]) and torch.equal(s["exp_avg_sq"], state[i]["exp_avg_sq"])


def test_compute_swaps_matmul_weights_only(tmp_path):
    """Inside compute(): Linear and expert weights are bf16 copies of their masters; embedding, norms and
    router stay fp32. After it: every parameter is its fp32 master again, holding an fp32 gradient."""
    cfg = tiny_train_config(tmp_path)
    model = build_model(cfg.model_config(), seed=0)
    chosen = {id(p) for p in matmul_parameters(model)}
    expected = {id(p) for m in model.modules() if isinstance(m, nn.Linear | GroupedExperts) for p in m.parameters()}
    assert chosen == expected and id(model.embed_tokens.weight) not in chosen
    masters = {name: p.detach().clone() for name, p in model.named_parameters()}
    master_weights = MasterWeights(model)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 8))
    with master_weights.compute():
        for name, p in model.named_parameters():
            if id(p) in chosen:
                assert p.dtype == torch.bfloat16 and torch.equal(p, masters[name].bfloat16()), name
            else:
                assert p.dtype == torch.float32, name
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids).float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, masters[name]), name
        if id(p) in chosen and not name.startswith("mtp."):  # forward() runs no MTP module
            assert p.grad.dtype == torch.float32, name


def test_tied_embedding_stays_fp32(tmp_path):
    cfg = tiny_train_config(tmp_path, model={"tie_word_embeddings": True})
    model = build_model(cfg.model_config(), seed=0)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert id(model.embed_tokens.weight) not in {id(p) for p in matmul_parameters(model)}


def test_fp32_run_has_no_master_weights(tmp_path, make_loader):
    cfg = tiny_train_config(tmp_path, dtype="fp32")
    assert Trainer(cfg, build_model(cfg.model_config(), seed=0), make_loader(cfg)).master_weights is None
