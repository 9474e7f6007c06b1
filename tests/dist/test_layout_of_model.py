"""The Layout read from real parallelized models (DTensor placements incl. FSDP's strided shards over
TP/EP, HSDP replicas, V-schedule pipeline stages) equals the described one, and every rank's local
data is exactly the single-device tensor's box the layout names — for a parallelized built model and
for the any-size build (parallel/materialize.build_sharded, same seed as its one-device build)."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import model_config
from dist_launcher import launch

from seekforge.config import ParallelConfig
from seekforge.model.model import build_model
from seekforge.parallel.layout import describe_layout, layout_of_model
from seekforge.parallel.materialize import build_sharded
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.parallel.transfer import shards_of

LAYERS = 4  # a V schedule over pp=2 needs 4 stages


def _check_layouts(layouts: list[dict]):
    cfg = model_config(num_hidden_layers=LAYERS)
    reference = build_model(cfg, seed=0).state_dict()
    seeded = build_sharded(cfg, ParallelConfig(), None, seed=7)[0].state_dict()
    out = []
    for kwargs in layouts:
        pc = ParallelConfig(**kwargs)
        model = build_model(cfg, seed=0)
        if pc.pp > 1:
            from seekforge.parallel.pp import PipelineRunner

            model = PipelineRunner(model, pc, build_mesh(pc, cfg)).modules
        else:
            model = parallelize(model, pc, build_mesh(pc, cfg))
        layout = layout_of_model(model)
        described = describe_layout(cfg, pc)
        same = layout.tensors.keys() == described.tensors.keys() and all(
            layout.tensors[n].pieces() == described.tensors[n].pieces() for n in layout.tensors)
        data_ok = all(torch.equal(t, reference[name][tuple(slice(a, b) for a, b in box)])
                      for name, pieces in shards_of(model).items() for box, t in pieces)
        mine = set((n, b) for n, ps in shards_of(model).items() for b, t in ps if t.numel())
        in_layout = all(b in layout.tensors[n].rank_boxes().get(dist.get_rank(), []) for n, b in mine)
        # The any-size build (meta → parallelize → this rank's shards only) draws the single-device values.
        built = build_sharded(cfg, pc, build_mesh(pc, cfg), seed=7)
        seeded_ok = all(torch.equal(t, seeded[name][tuple(slice(a, b) for a, b in box)])
                        for name, pieces in shards_of(built).items() for box, t in pieces)
        out.append((str(kwargs), same, data_ok and seeded_ok, in_layout))
    return out


@pytest.mark.parametrize("layouts", [
    # experts: EP then FSDP over dp_shard_mod_ep=2 (a _StridedShard); rank 0 holds stages 0 and 3
    [dict(dp_shard=4, ep=2), dict(pp=2, pp_schedule="ZBVZeroBubble", microbatches=4, dp_shard=2)],
    pytest.param([dict(dp_replicate=2, dp_shard=2, ep=2), dict(dp_shard=2, tp=2, sequence_parallel=True)],
                 marks=pytest.mark.slow),
], ids=["strided-ep-and-zbv", "hsdp-and-tp-sp"])
def test_layout_of_model_matches_description_and_data(layouts):
    for rank_result in launch(_check_layouts, 4, layouts):
        for name, same, data_ok, in_layout in rank_result:
            assert same, f"{name}: layout_of_model != describe_layout"
            assert data_ok, f"{name}: a local shard does not hold its box of the single-device tensor"
            assert in_layout, name
