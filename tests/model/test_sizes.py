"""config/sizes.py, the one count of parameters and FLOPs, against models built from the same configs."""

import pytest

from seekforge.config import PRESETS, preset
from seekforge.config.sizes import flops_per_token, model_units
from seekforge.model.model import build_model

VARIANTS = {name: preset(name) for name in sorted(PRESETS)} | {
    "tiny-plain-q-tied": preset("tiny", q_lora_rank=None, tie_word_embeddings=True),
    "tiny-dense-no-mtp": preset("tiny", n_routed_experts=0, num_nextn_predict_layers=0),
    "tiny-every-other-moe": preset("tiny", num_hidden_layers=5, moe_layer_freq=2, num_nextn_predict_layers=2),
}


def numel(module) -> int:
    """Parameters plus the router's bias, a buffer here but a tensor of the HF checkpoint."""
    return (sum(p.numel() for p in module.parameters())
            + sum(b.numel() for name, b in module.named_buffers() if name.endswith("e_score_correction_bias")))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_unit_counts_its_modules_parameters(name):
    cfg = VARIANTS[name]
    model = build_model(cfg, device="meta")
    units = model_units(cfg)
    layers = [u for u in units if u.kind in ("dense", "moe")]
    mtp = [u for u in units if u.kind == "mtp"]
    assert units[0].kind == "embed" and units[0].params == model.embed_tokens.weight.numel()
    assert [u.params for u in layers] == [numel(block) for block in model.layers]
    assert [u.kind == "moe" for u in layers] == [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    head = model.norm.weight.numel() + (0 if cfg.tie_word_embeddings else model.lm_head.weight.numel())
    assert [u.params for u in units if u.kind == "head"] == [head]
    assert [u.params for u in mtp] == [numel(module) for module in model.mtp]
    counts = cfg.num_params()
    assert counts["total"] + counts["mtp"] == numel(model)
    # Active: each MoE block runs num_experts_per_tok of its routed experts.
    experts = [block.mlp.experts for block in model.layers if hasattr(block.mlp, "experts")]
    inactive = sum(numel(e) // cfg.n_routed_experts * (cfg.n_routed_experts - cfg.num_experts_per_tok)
                   for e in experts)
    assert counts["active"] == counts["total"] - inactive


def test_v3_sizes_match_published():
    n = preset("v3-671b").num_params()
    assert abs(n["total"] / 671e9 - 1) < 0.02
    assert abs(n["active"] / 37e9 - 1) < 0.02


@pytest.mark.parametrize("with_mtp", [True, False])
@pytest.mark.parametrize("name", ["tiny", "tiny-plain-q-tied", "tiny-every-other-moe"])
def test_flops_per_token_is_a_hand_count_over_the_built_model(name, with_mtp):
    """6 FLOPs per token per weight a token multiplies through (PaLM appendix B), routed experts K of E,
    the embedding a lookup, the head once per call (main model + each MTP depth), the router's bias
    not a weight; plus QKᵀ and PV over the full T×T square in every block."""
    cfg, seq_len = VARIANTS[name], 128
    model = build_model(cfg, device="meta")
    modules = [model.lm_head, *model.layers] + (list(model.mtp) if with_mtp else [])
    weights = 0
    for module in modules:
        for param_name, p in module.named_parameters():
            share = cfg.num_experts_per_tok / cfg.n_routed_experts if ".experts." in f".{param_name}" else 1
            weights += p.numel() * share
    weights += len(model.mtp) * model.lm_head.weight.numel() if with_mtp else 0  # each MTP depth calls the head
    blocks = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    attention = blocks * seq_len * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert flops_per_token(cfg, seq_len, with_mtp) == pytest.approx(6 * (weights + attention), rel=1e-12)
