import subprocess
import sys

import pytest

from seekforge.config import ModelConfig, preset


def test_presets_sizes():
    assert preset("tiny").num_params()["total"] < 2e6
    small = preset("small")
    assert 20e6 <= small.num_params()["total"] + small.num_params()["mtp"] <= 60e6
    assert small.n_routed_experts >= 8


def test_info_cli_prints_billions():
    out = subprocess.run([sys.executable, "-m", "seekforge", "info", "--preset", "v3-671b"],
                         capture_output=True, text=True, check=True).stdout
    assert "total 671.0B" in out and "activated 37.6B" in out
    assert any(line.startswith("mtp ") for line in out.splitlines())


@pytest.mark.parametrize("bad,key", [
    ({"topk_group": 9, "n_group": 8}, "topk_group"),
    ({"n_group": 3}, "n_group"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"q_lora_rank": 0}, "q_lora_rank"),
])
def test_invalid_values_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig(**bad)


def test_from_hf_keeps_unknown_keys_and_reads_both_rope_layouts(tmp_path):
    raw = {**preset("tiny").to_hf(), "some_future_key": 3, "q_lora_rank": None}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.extra["some_future_key"] == 3 and cfg.q_lora_rank is None
    assert cfg.to_hf()["some_future_key"] == 3
    # transformers 5 layout: rope_parameters with rope_theta inside
    raw2 = {**raw, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0,
                                       "original_max_position_embeddings": 64}}
    raw2.pop("rope_theta")
    raw2.pop("rope_scaling")
    cfg2 = ModelConfig.from_hf(raw2)
    assert cfg2.rope_theta == 5000.0 and cfg2.rope_scaling["factor"] == 4.0
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_hf(tmp_path)


def test_parse_bytes():
    from seekforge.config import parse_bytes

    assert parse_bytes("5GB") == 5 * 10**9 and parse_bytes("2MiB") == 2**21 and parse_bytes(1000) == 1000
    assert parse_bytes("512mib") == 2**29 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_memory 'lots' is not a size"):
        parse_bytes("lots", "EngineConfig.kv_cache_memory")
