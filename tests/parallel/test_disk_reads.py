"""Sliced reads of HF checkpoints (parallel/disk.py) without a process group: every rank's boxes of a
layout, read separately, reassemble exactly what model/hf.load_hf loads — bf16/fp32 and FP8 (slices
that start inside a 128×128 scale block)."""

import pytest
import torch

from seekforge.config import ParallelConfig, preset
from seekforge.model.hf import load_hf, save_hf
from seekforge.model.model import build_model
from seekforge.parallel.disk import read_hf_shards
from seekforge.parallel.layout import describe_engine_layout, describe_layout
from seekforge.parallel.transfer import allocate_shards

# Dense MLP rows split in two (192 = 1.5 blocks) and in three (ceil(384/3) = 128, but 320/3 → 107):
# slices start inside FP8 scale blocks.
CFG = dict(hidden_size=320, intermediate_size=384, moe_intermediate_size=160, num_hidden_layers=2)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_every_rank_reads_its_slices(tmp_path, fp8):
    cfg = preset("tiny", **CFG)
    save_hf(build_model(cfg, seed=0), tmp_path / "hf", max_shard_size="300KB", fp8=fp8)
    expected = load_hf(tmp_path / "hf").state_dict()
    layouts = [describe_engine_layout(cfg, tp=2, ep=2), describe_layout(cfg, ParallelConfig(dp_shard=3))]
    for layout in layouts:
        full = {name: torch.full(t.shape, float("nan")) for name, t in expected.items()}
        for rank in range(layout.world_size):
            shards = allocate_shards(layout, rank)
            read = read_hf_shards(tmp_path / "hf", shards)
            held = sum(t.numel() * t.element_size() for ps in shards.values() for _, t in ps)  # fp32
            # fp32 files: exactly the rank's bytes. FP8: 1-byte slices plus their covering block scales.
            assert read == held if not fp8 else read < held
            for name, pieces in shards.items():
                for box, t in pieces:
                    full[name][tuple(slice(a, b) for a, b in box)] = t
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
