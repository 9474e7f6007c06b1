"""Sharded builds on gloo ranks hold exactly the single-device build's weights (same seed), both
drawn per box and read per box from an HF checkpoint."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import model_config
from dist_launcher import launch

from seekforge.config import ParallelConfig
from seekforge.parallel.materialize import build_sharded, load_sharded, materialize, meta_modules
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.transfer import shards_of


def _build(pc: dict, hf: str | None):
    cfg, pc = model_config(), ParallelConfig(**pc)
    mesh = build_mesh(pc, cfg)
    if hf is None:
        modules = build_sharded(cfg, pc, mesh, seed=7)
        read = 0
    else:
        modules = materialize(meta_modules(cfg, pc, mesh), cfg, seed=None)
        read = load_sharded(modules, hf)
    shards = shards_of(modules)
    assert all(not t.is_meta for ps in shards.values() for _, t in ps)
    held = sum(t.numel() * t.element_size() for ps in shards.values() for _, t in ps)
    return {"shards": {n: [(b, t.clone()) for b, t in ps] for n, ps in shards.items()}, "read": read,
            "held": held, "rank": dist.get_rank()}


def _assemble(results) -> dict[str, torch.Tensor]:
    full = {}
    for r in results:
        for name, pieces in r["shards"].items():
            for box, t in pieces:
                full.setdefault(name, {})[box] = t
    return full


def _check(results, reference):
    full = _assemble(results)
    assert full.keys() == reference.keys()
    for name, ref in reference.items():
        value = torch.full(ref.shape, float("nan"))
        for box, t in full[name].items():
            value[tuple(slice(a, b) for a, b in box)] = t
        torch.testing.assert_close(value, ref, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_sharded_init_tp_pp_and_hf_reads_fill_the_same_shards(tmp_path):
    from seekforge.model.hf import save_hf

    cfg = model_config()
    single = build_sharded(cfg, ParallelConfig(), None, seed=7)[0]
    reference = single.state_dict()
    for layout in (dict(dp_shard=2, tp=2, ep=2), dict(pp=2, microbatches=2, tp=2)):
        _check(launch(_build, 4, layout, None), reference)
    save_hf(single, tmp_path / "hf")
    results = launch(_build, 2, dict(dp_shard=2, ep=2), str(tmp_path / "hf"))
    _check(results, reference)
    for r in results:
        assert r["read"] == r["held"]
