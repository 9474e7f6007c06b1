"""Resharding between real layouts on gloo ranks, in memory (parallel/transfer.py) and from disk
(parallel/disk.py): every destination ends up holding exactly the single-device weights (atol 0: the
executors only copy), the in-memory plan moves exactly its lower bound, and the Layout read from
each parallelized model equals the one described from its configs."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import model_config, run_layout
from dist_launcher import launch

from seekforge.config import ParallelConfig
from seekforge.model.model import build_model
from seekforge.parallel.layout import Layout, describe_engine_layout, describe_layout, layout_of_model
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.parallel.reshard import lower_bound_bytes
from seekforge.parallel.transfer import allocate_shards, shards_of, sync_shards

CAP = 64 * 2**10  # a small memory cap, so the tiny model's sync runs in many rounds


def _parallel_model(pc: ParallelConfig, seed: int):
    cfg = model_config()
    if pc.pp > 1:
        from seekforge.parallel.pp import PipelineRunner

        return PipelineRunner(build_model(cfg, seed=seed), pc, build_mesh(pc, cfg)).modules
    return parallelize(build_model(cfg, seed=seed), pc, build_mesh(pc, cfg))


def _same_pieces(a, b) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[n].pieces() == b.tensors[n].pieces() for n in a.tensors)


def _sync(src_pc: dict, dst: dict):
    """Source: seed 0 under src_pc on every rank. Destination: a parallelized model (seed 1, so every
    value must be overwritten), an engine layout, or a plain model on rank 0 only."""
    cfg = model_config()
    src_pc = ParallelConfig(**src_pc)
    src_model = _parallel_model(src_pc, seed=0)
    src_layout = layout_of_model(src_model)
    out = {"described_src": _same_pieces(src_layout, describe_layout(cfg, src_pc))}
    if "engine" in dst:
        dst_layout = describe_engine_layout(cfg, **dst["engine"])
        dst_shards = allocate_shards(dst_layout, dist.get_rank())
    else:
        if "parallel" in dst:
            dst_model = _parallel_model(ParallelConfig(**dst["parallel"]), seed=1)
        else:  # one process: rank 0 alone
            dst_model = build_model(cfg, seed=1) if dist.get_rank() == 0 else []
        dst_layout = layout_of_model(dst_model)
        dst_shards = shards_of(dst_model)
    stats = sync_shards(src_layout, dst_layout, shards_of(src_model), dst_shards, memory_cap=CAP)
    out.update(shards={n: [(b, t.clone()) for b, t in ps] for n, ps in dst_shards.items()}, stats=stats,
               lower_bound=lower_bound_bytes(src_layout, dst_layout), dst_world=dst_layout.world_size)
    return out


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's boxes; checks that each element is covered and copies agree."""
    reference = build_model(model_config(), seed=0).state_dict()
    full = {}
    for name, ref in reference.items():
        value = torch.full(ref.shape, float("nan"), dtype=torch.float64)
        for shards in per_rank:
            for box, t in shards.get(name, []):
                index = tuple(slice(a, b) for a, b in box)
                seen = value[index]
                assert torch.isnan(seen).all() or torch.equal(seen, t.double()), f"replicas of {name} disagree"
                value[index] = t.double()
        assert not torch.isnan(value).any(), f"{name} is not fully covered"
        full[name] = value
    return full


def assert_single_device_weights(per_rank: list[dict]):
    reference = build_model(model_config(), seed=0).state_dict()
    full = assemble(per_rank)
    assert full.keys() == reference.keys()
    for name, ref in reference.items():
        torch.testing.assert_close(full[name], ref.double(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("world, src, dst", [
    (2, dict(dp_shard=2), dict(parallel=dict(tp=2))),
    pytest.param(4, dict(dp_shard=2, tp=2, ep=2), dict(engine=dict(dp_attention=2, ep=2)), marks=pytest.mark.slow),
    pytest.param(2, dict(pp=2, microbatches=2), dict(single=True), marks=pytest.mark.slow),
], ids=["fsdp2-to-tp2", "tp2xep2-to-dpattn2+ep2", "pp2-to-one-rank"])
def test_in_memory_sync(world, src, dst):
    results = launch(_sync, world, src, dst)
    assert all(r["described_src"] for r in results), "layout_of_model disagrees with describe_layout"
    assert_single_device_weights([r["shards"] for r in results])
    moved = sum(r["stats"].bytes_sent for r in results)
    assert moved == sum(r["stats"].bytes_received for r in results) == results[0]["lower_bound"]
    assert results[0]["stats"].rounds > 1  # the memory cap split it
    print(f"{src} -> {dst}: moved {moved} B in {results[0]['stats'].rounds} rounds (lower bound "
          f"{results[0]['lower_bound']} B)")


def _read_checkpoint(kind: str, path: str, engine: dict):
    from seekforge.parallel.disk import read_dcp_shards, read_hf_shards

    layout = describe_engine_layout(model_config(), **engine)
    shards = allocate_shards(layout, dist.get_rank())
    read = read_hf_shards(path, shards) if kind == "hf" else read_dcp_shards(path, shards)
    held = sum(t.numel() * t.element_size() for ps in shards.values() for _, t in ps)
    return {"shards": shards, "read": read, "held": held}


@pytest.mark.slow
def test_resume_four_rank_training_checkpoint_on_two_rank_engine(tmp_path):
    from seekforge.train.checkpoint import latest_checkpoint

    ckpt = str(tmp_path / "checkpoints")
    trained = launch(run_layout, 4, {}, dict(dp_shard=2, tp=2, ep=2), (0, 1), None, ckpt)[0]["weights"]
    saved = Layout.load(latest_checkpoint(ckpt) / "layout.json")  # written by save_checkpoint
    described = describe_layout(model_config(), ParallelConfig(dp_shard=2, tp=2, ep=2))
    assert saved.world_size == 4 and all(saved.tensors[n].pieces() == t.pieces() for n, t in described.tensors.items())
    results = launch(_read_checkpoint, 2, "dcp", str(latest_checkpoint(ckpt)), dict(tp=2, ep=2))
    full = assemble([r["shards"] for r in results])
    for name, value in trained.items():
        torch.testing.assert_close(full[name], value.double(), rtol=0, atol=0, msg=name)
    # DCP reads whole stored chunks: at least what each rank holds, never the whole checkpoint per rank.
    total = sum(v.numel() * v.element_size() for v in trained.values())
    for r in results:
        assert r["held"] <= r["read"] < total


@pytest.mark.slow
def test_hf_safetensors_read_only_own_slices(tmp_path):
    from seekforge.model.hf import save_hf

    save_hf(build_model(model_config(), seed=0), tmp_path / "hf", max_shard_size="200KB")
    assert len(list(Path(tmp_path / "hf").glob("*.safetensors"))) > 1
    results = launch(_read_checkpoint, 2, "hf", str(tmp_path / "hf"), dict(tp=2, ep=2))
    assert_single_device_weights([r["shards"] for r in results])
    for r in results:
        assert r["read"] == r["held"]  # get_slice: exactly this rank's bytes
