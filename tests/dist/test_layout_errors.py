"""Bad layouts fail before any process group or tensor exists, with one ValueError naming the fix."""

import pytest
import torch.multiprocessing as mp
from dist_harness import model_config
from dist_launcher import launch

from seekforge.config import ParallelConfig
from seekforge.parallel.mesh import build_mesh


@pytest.mark.parametrize("layout, world, message", [
    (dict(dp_shard=2, tp=2), 2, r"= 4, but the world size is 2; use dp_shard=1"),
    (dict(tp=3), 3, r"tp=3 does not divide num_attention_heads=4; pick tp in \[1, 2, 4\]"),
    (dict(dp_shard=3, ep=3), 3, r"ep=3 does not divide n_routed_experts=8; pick ep in \[1, 2, 4, 8\]"),
    (dict(pp=4, microbatches=4), 4, r"pp=4 with 1F1B needs 4 stages but the model has num_hidden_layers=3"),
    (dict(pp=2, pp_schedule="ZBVZeroBubble", microbatches=4), 2, r"needs 4 stages .* num_hidden_layers=3"),
    (dict(pp=2, pp_schedule="1F1B", microbatches=1), 2, r"microbatches=1 < pp=2"),
])
def test_layout_checks(layout, world, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**layout).validate(world, model_config())


def test_ep_on_a_model_without_routed_experts_is_refused():
    dense = model_config().replace(first_k_dense_replace=3)  # every layer dense
    with pytest.raises(ValueError, match=r"ep=2 splits routed experts, but this model has none"):
        ParallelConfig(dp_shard=2, ep=2).validate(2, dense)


@pytest.mark.parametrize("layout, message", [
    (dict(dp_shard=2, ep=4), r"ep=4 does not divide dp_shard=2"),
    (dict(pp_schedule="Zigzag"), r"pp_schedule='Zigzag': choose one of"),
    (dict(tp=0), r"tp=0: must be a positive integer"),
    (dict(tp=2, pp=2, sequence_parallel=True), r"sequence_parallel=True with pp > 1 is not supported"),
])
def test_config_checks(layout, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**layout)


def build_bad_mesh():
    build_mesh(ParallelConfig(dp_shard=2, tp=2), model_config())  # 4 ranks' worth on 2 ranks


def test_build_mesh_fails_on_every_rank_before_allocating():
    with pytest.raises(mp.ProcessRaisedException, match=r"ValueError: .* but the world size is 2"):
        launch(build_bad_mesh, 2)
