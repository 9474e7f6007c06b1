"""The stage balancer against brute force, and on the v3-671b preset."""

import itertools
import time

import numpy as np
import pytest

from seekforge.config import ParallelConfig, preset
from seekforge.plan.balance import (
    MODES,
    LayerCosts,
    analytic_costs,
    balance_stages,
    even_split,
    inflight_per_stage,
    simulated_step,
)


def random_costs(rng: np.random.Generator, n: int) -> LayerCosts:
    time = rng.uniform(0.5, 2.0, n)
    acts = rng.uniform(1.0, 3.0, n)
    return LayerCosts(
        time=time,
        recompute={"none": 0 * time, "selective": 0.2 * time, "full": 0.33 * time},
        activations={"none": acts, "selective": 0.5 * acts, "full": 0.1 * acts},
        state=rng.uniform(1.0, 4.0, n),
        first_time=0.1, first_state=2.0, first_activations=0.5,
        last_time=float(rng.uniform(0.5, 2.0)), last_state=3.0,
        last_activations={"none": 2.0, "selective": 1.5, "full": 1.0})


def brute_force(costs: LayerCosts, stages: int, microbatches: int, limit: float) -> float:
    n = len(costs.time)
    inflight = [min(microbatches, stages - s) for s in range(stages)]
    best = np.inf
    for points in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *points, n]
        for modes in itertools.product(MODES, repeat=stages):
            times, fits = [], True
            for s, mode in enumerate(modes):
                a, b = bounds[s], bounds[s + 1]
                t = costs.time[a:b].sum() + costs.recompute[mode][a:b].sum()
                acts = costs.activations[mode][a:b].sum()
                state = costs.state[a:b].sum()
                if s == 0:
                    t, state, acts = t + costs.first_time, state + costs.first_state, acts + costs.first_activations
                if s == stages - 1:
                    t, state = t + costs.last_time, state + costs.last_state
                    acts += costs.last_activations[mode]
                fits &= state + inflight[s] * acts <= limit
                times.append(t)
            if fits:
                best = min(best, sum(times) + (microbatches - 1) * max(times))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_balancer_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, stages = int(rng.integers(4, 13)), int(rng.integers(2, 5))
    stages = min(stages, n)
    microbatches = int(rng.integers(stages, 3 * stages + 1))
    costs = random_costs(rng, n)
    limit = float(rng.uniform(8.0, 30.0))
    expected = brute_force(costs, stages, microbatches, limit)
    if not np.isfinite(expected):
        with pytest.raises(ValueError, match="fits"):
            balance_stages(costs, stages, microbatches, limit)
        return
    got = balance_stages(costs, stages, microbatches, limit)
    assert got.step_time == pytest.approx(expected, rel=1e-12)
    assert max(got.stage_memory) <= limit


def test_v3_pp16_beats_the_even_split_quickly():
    cfg = preset("v3-671b")
    pc = ParallelConfig(pp=16, microbatches=32, dp_shard=64, ep=64)
    start = time.perf_counter()
    costs = analytic_costs(cfg, pc, micro_batch_size=1, seq_len=4096, flops_per_second=400e12)
    inflight = inflight_per_stage(pc)
    limit = 70e9
    best = balance_stages(costs, 16, 32, limit, inflight)
    assert time.perf_counter() - start < 60
    fitting_even = [even_split(costs, 16, 32, m, inflight) for m in MODES]
    fitting_even = [e for e in fitting_even if max(e.stage_memory) <= limit]
    assert fitting_even, "full recompute on an even split fits 70 GB"
    even = min(fitting_even, key=lambda e: e.step_time)
    assert max(best.stage_memory) <= limit
    assert best.step_time < even.step_time
    assert simulated_step(costs, best, "1F1B", 16, 32) < simulated_step(costs, even, "1F1B", 16, 32)
    arg = best.parallel_arg(cfg, pc)
    assert "pp_split_points=[" in arg and arg.count(",") > 15


def test_parallel_arg_round_trips_through_the_config():
    from seekforge.config import parse_parallel  # the pretrain CLI's parser

    cfg = preset("small")
    pc = ParallelConfig(pp=2, microbatches=4)
    costs = analytic_costs(cfg, pc, micro_batch_size=2, seq_len=256, flops_per_second=1e12)
    best = balance_stages(costs, 2, 4, 1e12)
    parsed = ParallelConfig(**parse_parallel(best.parallel_arg(cfg, pc)))
    parsed.validate(2, cfg)
    assert parsed.pp_split_points == best.split_points
