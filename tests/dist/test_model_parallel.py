"""TP (with and without sequence parallel), EP and TP+EP reproduce single-device training."""

import pytest
from dist_harness import assert_matches_reference, model_config, reference_run, run_layout
from dist_launcher import launch

# fp32, 3 steps. Weights at 1e-5 too: dist_harness.make_optimizer's eps keeps AdamW from amplifying
# reduction-order noise in near-zero gradients; a real gradient error moves weights by about lr = 1e-3 a step.
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def reference():
    return reference_run(model_config())


@pytest.mark.parametrize("layout, world", [
    (dict(tp=2), 2),
    (dict(tp=2, sequence_parallel=True), 2),
    (dict(dp_shard=2, ep=2, recompute="full"), 2),
    (dict(dp_shard=2, ep=2, tp=2, sequence_parallel=True), 4),
], ids=["tp", "tp-sp", "ep-recompute", "tp-sp-ep"])
def test_model_parallel_matches_single_device(reference, layout, world):
    results = launch(run_layout, world, {}, layout)
    worst = assert_matches_reference(results, reference, LOSS_TOL, WEIGHT_TOL)
    print(f"{layout}: max weight diff {worst:.2e}")
