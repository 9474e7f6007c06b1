"""compressed-tensors checkpoints: our writer, our reader, and the library's own (de)compressors."""

import copy
import json
import os

import pytest
import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from safetensors.torch import save_file

from seekforge.model.generate import generate
from seekforge.model.hf import save_hf
from seekforge.quant.calibrate import quantize_model
from seekforge.quant.checkpoint import load_compressed, quantized_modules, save_compressed
from seekforge.quant.linear import QuantExperts
from seekforge.quant.recipe import Recipe
from seekforge.quant.schemes import rtn

RECIPES = [dict(scheme="w8a8-static"), dict(scheme="w8a8-dynamic"), dict(scheme="w4a16", group_size=32),
           dict(scheme="w4a16-asym", group_size=32, method="gptq")]


@pytest.fixture(scope="module", params=RECIPES, ids=lambda r: r["scheme"])
def saved(request, tiny, samples, tmp_path_factory):
    model = copy.deepcopy(tiny)
    quantize_model(model, Recipe(**request.param), samples, progress=False)
    path = tmp_path_factory.mktemp("ct")
    save_compressed(model, path)
    return model, path


def test_round_trip_gives_the_same_model(saved):
    model, path = saved
    loaded = load_compressed(path)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_the_weights_file_is_readable_by_others_as_any_new_file(saved):
    """safetensors' save_file leaves 0600; a server under another account could not read the checkpoint."""
    _, path = saved
    umask = os.umask(0)
    os.umask(umask)
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_the_full_precision_loader_names_what_loads_it(saved):
    """load_hf (generate, convert, quantize, GRPO's base) refuses a compressed checkpoint by what it is."""
    from seekforge.errors import UserError
    from seekforge.model.hf import load_hf

    with pytest.raises(UserError, match="quantized .compressed-tensors. checkpoint.*seekforge serve"):
        load_hf(saved[1])


def test_a_truncated_checkpoint_is_one_error_naming_the_file(saved, tmp_path):
    """As the full-precision loader says it (model/hf.open_shard), not safetensors' own error from deep inside."""
    import shutil

    damaged = shutil.copytree(saved[1], tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file.*truncated or corrupt"):
        load_compressed(damaged)


def test_loads_in_bf16_and_decodes(saved):
    """bf16 activations: the absorbed decode path reads kv_b_proj.weight in the model's dtype."""
    _, path = saved
    model = load_compressed(path, torch.bfloat16)
    assert model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    out = generate(model, [1, 2, 3], max_new_tokens=3)
    assert len(out) == 3


def our_dequantized(model):
    """HF name → our dequantized weight, experts split back into gate/up/down."""
    out = {}
    for hf, (_, module) in quantized_modules(model).items():
        if isinstance(module, QuantExperts):
            for e, (gate_up, down) in enumerate(zip(module.gate_up, module.down, strict=True)):
                gate, up = gate_up.dequantized().chunk(2)
                out.update({f"{hf}.{e}.gate_proj": gate, f"{hf}.{e}.up_proj": up,
                            f"{hf}.{e}.down_proj": down.dequantized()})
        else:
            out[hf] = module.dequantized()
    return out


def test_compressed_tensors_decompression_gives_our_dequantized_weights_exactly(saved):
    model, path = saved
    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    ours = our_dequantized(model)
    assert ours
    for name, weight in ours.items():
        group = qc.config_groups["group_1"] if (name.endswith("kv_b_proj") and "group_1" in qc.config_groups) \
            else qc.config_groups["group_0"]
        compressor = BaseCompressor.load_from_registry(group.format)
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
        decompressed = compressor.decompress(local, group)["weight"]
        assert torch.equal(decompressed, weight), name


def test_reads_a_checkpoint_written_by_compressed_tensors_compressor(tiny, tmp_path):
    """Every linear compressed by the library's own PackedQuantizationCompressor (asymmetric int4, group
    32); our reader must give the library's dequantized weights."""
    save_hf(tiny, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
    qc = QuantizationConfig.model_validate({
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": weights}}})
    group = qc.config_groups["group_0"]
    compressor = BaseCompressor.load_from_registry("pack-quantized")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out, expected = {}, {}
    for name, w in tensors.items():
        base = name.removesuffix(".weight")
        # layer 3 is the MTP layer: never quantized
        if not name.endswith(("_proj.weight", "_mqa.weight")) or "layers.3." in name:
            out[name] = w
            continue
        _, scale, zp = rtn(w, Recipe(scheme="w4a16-asym", group_size=32).quant_scheme.weights)
        compressed = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, group)
        out.update({f"{base}.{k}": v for k, v in compressed.items()})
        expected[base] = compressor.decompress(compressed, group)["weight"]
    save_file(out, tmp_path / "model.safetensors")
    config["quantization_config"] = qc.model_dump()
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_compressed(tmp_path)
    ours = our_dequantized(loaded)
    assert set(ours) == set(expected)
    for name, weight in ours.items():
        assert torch.equal(weight, expected[name]), name


@pytest.mark.slow
def test_reads_a_checkpoint_llm_compressor_made_for_a_transformers_deepseek_v3(tmp_path):
    """llm-compressor's oneshot (W4A16, group 128, RTN) on a transformers DeepseekV3 model; our model from
    its checkpoint must match transformers' own (compressed-tensors-decompressed) load of it. llm-compressor
    pins other compressed-tensors/transformers versions than this venv's, so it is not a declared test
    dependency: run with it on PYTHONPATH (BENCHMARKS.md, quant_decode.py's section, says how)."""
    pytest.importorskip("llmcompressor")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=320, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                           num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                           max_position_embeddings=256)
    DeepseekV3ForCausalLM(cfg).save_pretrained(tmp_path / "fp")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp")
    recipe = QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head", "re:.*mlp.gate$"])
    oneshot(model=model, recipe=recipe, output_dir=str(tmp_path / "w4"), tokenizer=None)
    ours = load_compressed(tmp_path / "w4")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "w4", dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, rtol=1e-5, atol=1e-5)
