"""HF interop (model/hf.py): logits parity with transformers in both directions, MTP and sharded
round trips, FP8 block quantization, and the errors a bad checkpoint raises.

Weights are re-drawn at unit scale (`randomize_`) so logits are O(1): with the default 0.02 init every
logit is ~0 and a 1e-4 tolerance would prove nothing.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from seekforge.config import ModelConfig
from seekforge.model.hf import (
    dequantize_fp8_block,
    hf_layout,
    is_fp8_linear,
    load_hf,
    quantize_fp8_block,
    save_hf,
)
from seekforge.model.model import build_model
from seekforge.model.rope import softmax_scale

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-4  # fp32, same math in a different order: measured ~4e-6 on O(1) logits
SEQ_LEN = 160  # > original_max_position_embeddings=64, so YaRN's interpolated frequencies matter

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             max_position_embeddings=256)
# mscale != mscale_all_dim: cos/sin are scaled by their ratio and the softmax by mscale_all_dim².
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
CASES = {
    "q_lora-yarn-4groups-interleave": dict(q_lora_rank=16, rope_parameters=YARN, n_group=4, topk_group=2,
                                           first_k_dense_replace=1, rope_interleave=True),
    "no_q_lora-plain_rope-no_interleave": dict(q_lora_rank=None, rope_parameters={"rope_type": "default",
                                               "rope_theta": 10000.0}, n_group=1, topk_group=1,
                                               first_k_dense_replace=0, rope_interleave=False,
                                               norm_topk_prob=False),
    "q_lora-yarn-2groups-no_interleave-2dense": dict(q_lora_rank=16, rope_parameters=YARN, n_group=2,
                                                     topk_group=1, first_k_dense_replace=2,
                                                     rope_interleave=False, num_experts_per_tok=3),
    "top1-normalized": dict(q_lora_rank=None, rope_parameters=YARN, n_group=2, topk_group=1,
                            first_k_dense_replace=1, num_experts_per_tok=1, norm_topk_prob=True),
}


def randomize_(model, seed=0):
    """Unit-scale weights (std 1/sqrt(fan_in)), norms near 1, a non-zero routing bias big enough to
    change which experts win. Works on HF and seekforge modules alike (same parameter names)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.rand(b.shape, generator=gen))
    return model


def hf_model(**case):
    config = transformers.DeepseekV3Config(**{**SIZES, **case})
    model = transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation="eager")
    return randomize_(model.eval())


def input_ids(seed=1):
    return torch.randint(0, SIZES["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def seekforge_config(**changes) -> ModelConfig:
    rope = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    return ModelConfig(**{**SIZES, "q_lora_rank": 16, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                          "num_nextn_predict_layers": 1, "rope_scaling": {"type": "yarn", **rope}, **changes})


# ------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_transformers_checkpoint_loads_with_same_logits(tmp_path, case):
    reference = hf_model(**case)
    reference.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="num_nextn_predict_layers"):  # transformers saves no MTP layer
        model = load_hf(tmp_path)
    ids = input_ids()
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids)
        assert expected.abs().max() > 1.0  # logits are O(1): the tolerance below is meaningful
        assert (got - expected).abs().max() < LOGITS_ATOL
        # The routing bias steers selection: dropping it must change the result.
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.zero_()
        assert (model(ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_seekforge_checkpoint_loads_in_transformers(tmp_path, q_lora_rank):
    cfg = seekforge_config(q_lora_rank=q_lora_rank, rope_interleave=q_lora_rank is None)
    assert softmax_scale(cfg) != cfg.qk_head_dim**-0.5  # YaRN's mscale_all_dim is in play
    model = randomize_(build_model(cfg)).eval()
    save_hf(model, tmp_path)
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = input_ids()
    with torch.no_grad():
        assert (reference(ids).logits - model(ids)).abs().max() < LOGITS_ATOL


# ------------------------------------------------------------------------------- round trips
def test_sharded_save_with_mtp_loads_back_bit_equal(tmp_path):
    cfg = seekforge_config(num_nextn_predict_layers=2)
    model = randomize_(build_model(cfg))
    save_hf(model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    names, total = set(), 0
    for shard in shards:
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard.name
                total += f.get_tensor(name).nbytes
                names.add(name)
    assert names == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    mtp = f"model.layers.{cfg.num_hidden_layers + 1}"  # the second MTP module, in the official layout
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "mlp.experts.7.down_proj.weight",
                   "self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"{mtp}.{suffix}" in names

    loaded = load_hf(tmp_path)
    expected, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys() and any(k.startswith("mtp.1.block.") for k in got)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_packed_expert_names_and_bf16_load(tmp_path):
    """transformers' internal stacked names load too; a bf16 load keeps the routing state fp32."""
    model = randomize_(build_model(seekforge_config()))
    save_hf(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(SIZES["n_routed_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del tensors[f"{prefix}.{e}.{proj}.weight"]
        tensors[f"{prefix}.gate_up_proj"] = model.layers[layer].mlp.experts.gate_up_proj.detach().clone()
        tensors[f"{prefix}.down_proj"] = model.layers[layer].mlp.experts.down_proj.detach().clone()
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_hf(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    half = load_hf(tmp_path, dtype=torch.bfloat16)
    moe = half.layers[1].mlp
    assert half.layers[1].self_attn.kv_b_proj.weight.dtype == moe.experts.down_proj.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert half.rotary.inv_freq.dtype == torch.float32 and moe.tokens_per_expert.dtype == torch.int64
    assert torch.equal(half.rotary.inv_freq, model.rotary.inv_freq) and not moe.tokens_per_expert.any()


def test_save_replaces_old_weights_and_keeps_other_files(tmp_path):
    model = randomize_(build_model(seekforge_config()))
    save_hf(model, tmp_path / "ckpt", max_shard_size="40KB")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    save_hf(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directory left behind
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"  # routing stays fp32
        assert f.get_slice("model.layers.1.mlp.experts.0.up_proj.weight").get_dtype() == "BF16"


# ------------------------------------------------------------------------------- FP8
def fp8_error_bounds(w, scale_inv, block=128):
    """Per-element bounds on |dequant(quant(w)) − w|, block-expanded like w.

    e4m3 keeps 3 mantissa bits: round-to-nearest errs by at most 2⁻⁴·|x| for normal values and by
    2⁻¹⁰ (half the subnormal step 2⁻⁹) below 2⁻⁶, in units of the block scale. The coarser bound the
    format is usually quoted with is 2⁻⁴ of the block's max |w| (= 448 · scale_inv)."""
    s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
    tight = torch.maximum(2**-4 * w.abs(), 2**-10 * s) * (1 + 1e-6)  # + fp32 rounding of the scaling
    return tight, 2**-4 * 448 * s


def test_fp8_block_quantization_error_bound():
    gen = torch.Generator().manual_seed(0)
    # 300×200: edge blocks are partial; row magnitudes span 1e-4..1e2 so blocks have different scales.
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-4, 2, 300)[:, None]
    w[128:256, :128] = 0  # an all-zero block must survive (no 0/0 scale)
    w = w.bfloat16()
    w_fp8, scale_inv = quantize_fp8_block(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)
    err = (dequantize_fp8_block(w_fp8, scale_inv) - w.float()).abs()
    tight, block_max = fp8_error_bounds(w.float(), scale_inv)
    assert (err <= tight).all() and (err <= block_max).all()
    assert err[128:256, :128].max() == 0
    with pytest.raises(ValueError, match="scale_inv has shape"):
        dequantize_fp8_block(w_fp8, scale_inv[:2])


def test_fp8_checkpoint_loads_close_to_bf16(tmp_path):
    cfg = seekforge_config(hidden_size=160)  # > 128: weights span several blocks, some partial
    model = build_model(cfg, dtype=torch.bfloat16)  # the default init (std 0.02), see the tolerance below
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.uniform_(0, 0.5, generator=torch.Generator().manual_seed(0))
    save_hf(model, tmp_path, fp8=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.1.self_attn.q_a_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv").get_shape() == [1, 2]
    for quantized in ("self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "mlp.shared_experts.down_proj",
                      "mlp.experts.0.up_proj"):
        assert f"model.layers.1.{quantized}.weight_scale_inv" in names
    for kept in ("model.embed_tokens", "lm_head", "model.norm", "model.layers.1.mlp.gate",
                 "model.layers.1.input_layernorm", "model.layers.3.eh_proj", "model.layers.3.shared_head.head"):
        assert f"{kept}.weight" in names and f"{kept}.weight_scale_inv" not in names

    loaded = load_hf(tmp_path)
    original, got = model.state_dict(), loaded.state_dict()
    layout = hf_layout(model)
    for name, slot in layout.items():
        w, w_loaded = original[slot.target][slot.index].float(), got[slot.target][slot.index]
        if is_fp8_linear(name):
            tight, block_max = fp8_error_bounds(w, quantize_fp8_block(w)[1])
            assert ((w_loaded - w).abs() <= torch.minimum(tight, block_max)).all(), name
        else:
            assert torch.equal(w_loaded, w), name  # norms, embeddings, heads, router: exact

    ids = input_ids()
    with torch.no_grad():
        reference = model.float()(ids)  # the bf16 weights, computed in fp32 like the loaded model
        logits = loaded(ids)
        # Quantization noise only: measured 3.4–4.6% relative L2 and ~97% equal argmax over seeds 0–2.
        # (With unit-scale random weights every layer amplifies the ~3.6% RMS weight error: ~36%.)
        rel = (logits - reference).norm() / reference.norm()
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
        assert rel < 0.08 and agree > 0.9, f"relative L2 {rel:.3f}, argmax agreement {agree:.3f}"
        # ...and exactly the noise of the format: the same quantize → dequantize done in memory.
        for name, slot in layout.items():
            if is_fp8_linear(name):
                weight = model.state_dict()[slot.target][slot.index]
                weight.copy_(dequantize_fp8_block(*quantize_fp8_block(weight)))
        assert (model(ids) - logits).abs().max() < 1e-5


def test_fp8_scale_in_another_shard_or_missing(tmp_path):
    model = randomize_(build_model(seekforge_config()))
    save_hf(model, tmp_path, fp8=True)
    tensors = load_file(tmp_path / "model.safetensors")
    scale_name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    save_file({scale_name: tensors.pop(scale_name)}, tmp_path / "model-00002-of-00002.safetensors")
    save_file(tensors, tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "model.safetensors").unlink()
    weight_map = {**dict.fromkeys(tensors, "model-00001-of-00002.safetensors"),
                  scale_name: "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_hf(tmp_path)
    w = model.layers[0].mlp.down_proj.weight.detach()
    assert torch.equal(loaded.layers[0].mlp.down_proj.weight, dequantize_fp8_block(*quantize_fp8_block(w)))

    del weight_map[scale_name]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"FP8 tensor 'model\.layers\.0\.mlp\.down_proj\.weight'.*no .*_scale_inv"):
        load_hf(tmp_path)


def test_failed_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    import seekforge.model.hf as hf

    old = randomize_(build_model(seekforge_config()), seed=1)
    save_hf(old, tmp_path / "ckpt", max_shard_size="60KB")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    written = []

    def crash_on_second_shard(tensors, file, metadata=None):
        if written:
            raise OSError("disk full")
        written.append(file)
        save_file(tensors, file, metadata=metadata)

    monkeypatch.setattr(hf, "save_file", crash_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_hf(randomize_(build_model(seekforge_config()), seed=2), tmp_path / "ckpt", max_shard_size="60KB")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the temporary directory was removed


# ------------------------------------------------------------------------------- errors
@pytest.fixture
def saved(tmp_path):
    save_hf(randomize_(build_model(seekforge_config())), tmp_path, max_shard_size="60KB")
    return tmp_path


def rewrite_tensor(checkpoint, name, tensor=None):
    """Replace (or, with None, drop) one tensor in whichever shard holds it."""
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shard = checkpoint / index["weight_map"][name]
    tensors = load_file(shard)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, shard)
    return shard


def test_missing_tensor_is_named(saved):
    shard = rewrite_tensor(saved, "model.layers.2.mlp.experts.5.up_proj.weight")
    message = rf"lacks 1 tensor.*experts\.5\.up_proj\.weight' \(the index puts it in {shard.name}\)"
    with pytest.raises(ValueError, match=message):
        load_hf(saved)


def test_wrong_shape_names_tensor_and_file(saved):
    shard = rewrite_tensor(saved, "model.layers.0.self_attn.o_proj.weight", torch.zeros(32, 17))
    with pytest.raises(ValueError, match=rf"o_proj\.weight.*{shard.name}.*\(32, 17\).*\(32, 16\)"):
        load_hf(saved)


def test_unexpected_tensor_is_named(saved):
    rewrite_tensor(saved, "model.norm.weight", torch.ones(32))  # unchanged; learn which shard it is in
    shard = saved / json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    save_file({**load_file(shard), "model.layers.9.mlp.gate.weight": torch.zeros(8, 32)}, shard)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.9\.mlp\.gate\.weight'"):
        load_hf(saved)


def test_truncated_shard_names_file(saved):
    shard = sorted(saved.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=rf"{shard.name} is not a readable safetensors file"):
        load_hf(saved)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_shard_size 'five gigs' is not a size"):
        save_hf(build_model(seekforge_config()), tmp_path / "out", max_shard_size="five gigs")
    (tmp_path / "config.json").write_text(json.dumps(seekforge_config().to_hf()))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_hf(tmp_path)
