"""Pipeline schedules (alone, with FSDP + EP, with TP) reproduce single-device training."""

import pytest
from dist_harness import assert_matches_reference, model_config, reference_run, run_layout
from dist_launcher import launch

# fp32, 3 steps. Weights at 1e-5 too: dist_harness.make_optimizer's eps keeps AdamW from amplifying
# reduction-order noise in near-zero gradients; a real gradient error moves weights by about lr = 1e-3 a step.
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5
LAYERS = 4  # V and interleaved schedules need 2 stages per rank, each with a layer


@pytest.fixture(scope="module")
def reference():
    return reference_run(model_config(num_hidden_layers=LAYERS))


@pytest.mark.parametrize("schedule", [
    "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV",
    *(pytest.param(name, marks=pytest.mark.slow) for name in ("GPipe", "LoopedBFS", "InterleavedZeroBubble")),
])
def test_pipeline_schedule_matches_single_device(reference, schedule):
    layout = dict(pp=2, pp_schedule=schedule, microbatches=4)
    results = launch(run_layout, 2, dict(num_hidden_layers=LAYERS), layout)
    print(schedule, f"max weight diff {assert_matches_reference(results, reference, LOSS_TOL, WEIGHT_TOL):.2e}")


def test_pipeline_with_fsdp_ep_and_per_block_recompute(reference):
    # 4 ranks: 2 pipeline ranks × 2 FSDP ranks, experts split over the FSDP ranks; recompute chosen per
    # block (4 layers, then the MTP block). Built through AutoParallel(model).hsdp(1, 2).ep(2)...
    # .pipeline("Interleaved1F1B", 2, pp=2).
    layout = dict(pp=2, dp_shard=2, ep=2, pp_schedule="Interleaved1F1B", microbatches=2,
                  recompute=["full", "none", "selective", "none", "full"])
    results = launch(run_layout, 4, dict(num_hidden_layers=LAYERS), layout, (0, 3), None, None, True)
    print(f"pp+fsdp max weight diff {assert_matches_reference(results, reference, LOSS_TOL, WEIGHT_TOL):.2e}")


def test_pipeline_with_tensor_parallel(reference):
    # 4 ranks: a V schedule (first and last stage, hence both embedding copies, on pp rank 0) × TP 2.
    layout = dict(pp=2, tp=2, pp_schedule="ZBVZeroBubble", microbatches=4)
    results = launch(run_layout, 4, dict(num_hidden_layers=LAYERS), layout)
    print(f"pp+tp max weight diff {assert_matches_reference(results, reference, LOSS_TOL, WEIGHT_TOL):.2e}")
