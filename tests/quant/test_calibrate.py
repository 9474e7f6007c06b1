"""Sequential calibration: GPTQ beats RTN, SmoothQuant is function-preserving, experts calibrate on their
own tokens (and fall back to RTN when none come), MLA's absorbed path stays exact."""

import copy

import pytest
import torch

from seekforge.config import preset
from seekforge.model.model import build_model
from seekforge.quant.awq import awq_scales
from seekforge.quant.calibrate import InputStats, quantize_model, smooth_block
from seekforge.quant.gptq import gptq_quantize, reconstruction_error
from seekforge.quant.linear import QuantExperts, QuantLinear
from seekforge.quant.recipe import Recipe, resolve
from seekforge.quant.schemes import QuantArgs, dequantize_weight, rtn


def correlated_inputs(n=512, dim=64):
    mix = torch.randn(dim, dim) / dim**0.5
    x = torch.randn(n, dim) @ mix
    x[:, :4] *= 8  # a few strong channels, as after an RMSNorm
    return x


@pytest.mark.parametrize("args", [QuantArgs(4, "group", group_size=32), QuantArgs(4, "group", False, 32),
                                  QuantArgs(8, "channel")])
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_reconstruction_error_below_rtn(args, actorder):
    w = torch.randn(48, 64)
    stats = InputStats()
    stats.add(correlated_inputs(), with_hessian=True)
    q, scale, zp = gptq_quantize(w, stats.hessian, args, actorder=actorder, block_size=32)
    gptq_err = reconstruction_error(w, q, scale, zp, stats.hessian, args)
    rtn_err = reconstruction_error(w, *rtn(w, args), stats.hessian, args)
    assert gptq_err < 0.8 * rtn_err
    assert q.min() >= args.qmin and q.max() <= args.qmax


def test_awq_scales_lower_the_output_error_of_rtn():
    args = QuantArgs(4, "group", group_size=32)
    x = correlated_inputs()
    w = torch.randn(48, 64)
    s = awq_scales(x, w, args)
    q, scale, _ = rtn(w * s, args)
    awq_out = x @ (dequantize_weight(q, scale, None, args) / s).t()
    q, scale, _ = rtn(w, args)
    rtn_out = x @ dequantize_weight(q, scale, None, args).t()
    ref = x @ w.t()
    assert (awq_out - ref).pow(2).mean() < (rtn_out - ref).pow(2).mean()


def test_smoothing_preserves_the_block_function(tiny_copy, samples):
    block = tiny_copy.layers[1]  # a MoE layer: router and every expert rescaled
    cos, sin = tiny_copy.rotary(torch.arange(48))
    inputs = [(tiny_copy.embed_tokens(s[None]), cos, sin) for s in samples[:2]]
    with torch.no_grad():
        before = [block(x, c, s) for x, c, s in inputs]
        plan = resolve(tiny_copy, Recipe(scheme="w8a8-static"))
        norm_before = block.post_attention_layernorm.weight.clone()
        from seekforge.quant.calibrate import QuantReport

        report = QuantReport()
        smooth_block(block, "model.layers.1.", plan, inputs, 0.5, report)
        after = [block(x, c, s) for x, c, s in inputs]
    assert not torch.equal(norm_before, block.post_attention_layernorm.weight)
    assert len(report.smoothed) == 3
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs, bound", [
    (dict(scheme="w8a8-dynamic"), 0.05), (dict(scheme="w8a8-static"), 0.08),
    (dict(scheme="w4a16", group_size=32), 0.25), (dict(scheme="w4a16", group_size=32, method="gptq"), 0.25),
    (dict(scheme="w4a16", group_size=32, method="awq"), 0.25),
])
def test_quantized_model_stays_close(tiny, samples, kwargs, bound):
    model = copy.deepcopy(tiny)
    report = quantize_model(model, Recipe(**kwargs), samples, progress=False)
    assert report.schemes
    ids = torch.randint(0, tiny.cfg.vocab_size, (2, 32))
    with torch.no_grad():
        ref, out = tiny(ids), model(ids)
    assert (out - ref).norm() / ref.norm() < bound
    if kwargs["scheme"] == "w8a8-static":
        scales = [m.input_scale for m in model.modules() if isinstance(m, QuantLinear) and m.input_scale is not None]
        assert scales and all(float(s) != 1.0 for s in scales)  # calibrated, not the init value


def test_experts_calibrate_on_their_own_tokens_and_unreached_ones_fall_back_to_rtn():
    cfg = preset("tiny")
    cfg.n_routed_experts, cfg.n_group, cfg.topk_group = 64, 1, 1
    model = build_model(cfg, seed=0).eval()
    samples = [torch.randint(0, cfg.vocab_size, (6,)) for _ in range(2)]  # 12 tokens × top-k < 64 experts
    original = {n: m.gate_up_proj.detach().clone() for n, m in model.named_modules() if hasattr(m, "gate_up_proj")}
    recipe = Recipe(scheme="w4a16", group_size=32, method="gptq")
    report = quantize_model(model, recipe, samples, progress=False)
    assert report.rtn_fallback
    moe_layers = sum(isinstance(getattr(layer.mlp, "experts", None), QuantExperts) for layer in model.layers)
    assert len(report.expert_rows) == 64 * moe_layers
    assert sum(n == 0 for n in report.expert_rows) == len(report.rtn_fallback)
    assert sum(report.expert_rows) == 12 * cfg.num_experts_per_tok * moe_layers  # each token's top-k copies
    assert f"{len(report.rtn_fallback)} fell back to RTN" in report.summary()
    name = report.rtn_fallback[0]  # model.layers.L.mlp.experts.E
    layer, expert = int(name.split(".")[2]), int(name.rsplit(".", 1)[1])
    experts = model.layers[layer].mlp.experts
    assert isinstance(experts, QuantExperts)
    q, _, _ = rtn(original[f"layers.{layer}.mlp.experts"][expert], recipe.quant_scheme.weights)
    assert torch.equal(experts.gate_up[expert].qweight, q)  # RTN exactly
    calibrated = [e for e in range(64) if f"model.layers.{layer}.mlp.experts.{e}" not in report.rtn_fallback]
    assert calibrated
    e = calibrated[0]
    q_rtn, _, _ = rtn(original[f"layers.{layer}.mlp.experts"][e], recipe.quant_scheme.weights)
    assert not torch.equal(experts.gate_up[e].qweight, q_rtn)  # GPTQ from its own tokens


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-dynamic"])
def test_absorbed_mla_equals_naive_with_quantized_kv_b_proj(tiny, samples, scheme):
    model = copy.deepcopy(tiny)
    quantize_model(model, Recipe(scheme=scheme, group_size=32 if scheme == "w4a16" else None), samples, progress=False)
    attn = model.layers[0].self_attn
    assert isinstance(attn.kv_b_proj, QuantLinear) and attn.kv_b_proj.scheme.input_activations is None
    cfg = model.cfg
    q_nope, q_pe = torch.randn(2, 1, cfg.num_attention_heads, cfg.qk_nope_head_dim), \
        torch.randn(2, 1, cfg.num_attention_heads, cfg.qk_rope_head_dim)
    c_kv, k_pe = torch.randn(2, 9, cfg.kv_lora_rank), torch.randn(2, 9, cfg.qk_rope_head_dim)
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    with torch.no_grad():
        naive = attn.attend_naive(q_nope, q_pe, c_kv, k_pe, mask=mask)
        absorbed = attn.attend_absorbed(q_nope, q_pe, c_kv, k_pe, mask=mask)
    torch.testing.assert_close(absorbed, naive, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kwargs", [dict(scheme="w4a16", group_size=32, method="gptq"), dict(scheme="w8a8-static")],
                         ids=["gptq", "w8a8-static"])
def test_every_routed_token_reaches_its_experts_statistics(samples, dtype, kwargs):
    """Calibration runs without autograd, where a MoE layer's inference paths (a one-token batch; the padded
    batch of every expert's rows, which bf16 takes at these sizes) skip the experts module, and with it the
    hook that gathers each expert's inputs: every token's top-k copies must reach their experts' statistics
    (GPTQ's Hessians, static input scales), so no routed expert falls back to RTN (issue 41, bug 9)."""
    model = build_model(preset("tiny"), seed=0, dtype=dtype).eval()
    calibration = samples[:4] + [samples[4][:1]]  # 4 × 48 tokens and one of 1
    original = {n: m.gate_up_proj.detach().clone() for n, m in model.named_modules() if hasattr(m, "gate_up_proj")}
    recipe = Recipe(**kwargs)
    report = quantize_model(model, recipe, calibration, progress=False)
    moe_layers = [i for i, layer in enumerate(model.layers) if isinstance(getattr(layer.mlp, "experts", None),
                                                                            QuantExperts)]
    assert moe_layers and not report.rtn_fallback
    tokens = sum(s.numel() for s in calibration)
    assert sum(report.expert_rows) == tokens * model.cfg.num_experts_per_tok * len(moe_layers)
    if recipe.method == "gptq":  # every expert rounded by its own Hessian, none by RTN
        for i in moe_layers:
            for e, unit in enumerate(model.layers[i].mlp.experts.gate_up):
                q_rtn, _, _ = rtn(original[f"layers.{i}.mlp.experts"][e], recipe.quant_scheme.weights)
                assert not torch.equal(unit.qweight, q_rtn)
