"""Layout descriptions from configs: JSON round trip, the printed table, per-rank bytes."""

import torch

from seekforge.config import ParallelConfig, preset
from seekforge.parallel.layout import Layout, describe_layout


def test_json_round_trip_and_table(tmp_path):
    cfg = preset("tiny")
    layout = describe_layout(cfg, ParallelConfig(dp_shard=2, tp=2, ep=2, pp=2, microbatches=2))
    layout.save(tmp_path / "layout.json")
    again = Layout.load(tmp_path / "layout.json")
    assert again.world_size == 8 and again.tensors.keys() == layout.tensors.keys()
    for name, t in layout.tensors.items():
        assert again.tensors[name].pieces() == t.pieces(), name
    table = layout.table()
    assert "layers.1.mlp.experts.gate_up_proj" in table
    assert "S0(ep,dp_shard_mod_ep)" in table  # EP then FSDP split the expert dim, in that order
    assert "S0(dp_shard) S1(tp)" in table  # o_proj: FSDP rows, TP columns


def test_every_element_is_held_and_bytes_add_up():
    cfg = preset("tiny")
    total = sum(t.numel() * 4 for t in __import__("seekforge.model.model", fromlist=["x"]).build_model(
        cfg, device="meta").state_dict().values())
    single = describe_layout(cfg, ParallelConfig())
    assert single.rank_bytes() == [total]
    # Pure FSDP: every parameter split once; buffers (the routing bias) whole on both ranks.
    fsdp = describe_layout(cfg, ParallelConfig(dp_shard=2))
    bias = sum(t.shape[0] * 4 for n, t in fsdp.tensors.items() if n.endswith("e_score_correction_bias"))
    assert sum(fsdp.rank_bytes()) == total + bias
    # Pipeline: the two stages hold disjoint layers; the embedding twice (MTP's copy on the last stage).
    pp = describe_layout(cfg, ParallelConfig(pp=2, microbatches=2))
    embed = cfg.vocab_size * cfg.hidden_size * 4
    assert sum(pp.rank_bytes()) == total + embed
    assert pp.tensors["embed_tokens.weight"].rank_boxes().keys() == {0, 1}
    assert pp.tensors["layers.0.input_layernorm.weight"].rank_boxes().keys() == {0}
    assert pp.tensors["lm_head.weight"].rank_boxes().keys() == {1}
    assert pp.tensors["lm_head.weight"].dtype == torch.float32


def test_checkpoints_carry_their_layout(tmp_path):
    from seekforge.model.model import build_model
    from seekforge.train.checkpoint import save_checkpoint

    cfg = preset("tiny")
    path = save_checkpoint(tmp_path, 1, build_model(cfg, seed=0))
    layout = Layout.load(path / "layout.json")
    described = describe_layout(cfg, ParallelConfig())
    assert layout.world_size == 1
    assert all(layout.tensors[n].pieces() == t.pieces() for n, t in described.tensors.items())
