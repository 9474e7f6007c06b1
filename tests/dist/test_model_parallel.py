"""TP (with and without sequence parallel), EP and TP+EP reproduce single-device training."""

import pytest
from dist_harness import assert_matches_reference, model_config, run_layout, reference_run
from dist_launcher import launch

# fp32. TP changes summation order (row-parallel all-reduce, vocab-parallel softmax); AdamW's
# normalized update turns that noise into ~1e-5 weight differences after 3 steps.
LOSS_TOL, WEIGHT_TOL = 1e-5, 5e-5


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
