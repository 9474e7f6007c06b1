"""Strategy search: plans fit, are ranked, and an impossible cluster says why."""

import time

import pytest

from seekforge.config import (
    ParallelConfig,
    parse_parallel,  # the pretrain CLI's --parallel parser
    preset,
)
from seekforge.plan.memory import estimate_memory
from seekforge.plan.search import Cluster, search, why_nothing_fits


def test_v2_lite_plans_fit_and_are_ranked():
    cfg = preset("v2-lite")
    cluster = Cluster(devices=16, device_memory=80e9)
    result = search(cfg, cluster, global_batch=64, seq_len=4096, top=5, micro_batch_sizes=(1,))
    assert result.plans
    speeds = [p.tokens_per_second for p in result.plans]
    assert speeds == sorted(speeds, reverse=True)
    for p in result.plans:
        assert p.parallel.world_size == 16
        assert p.peak_memory <= 80e9 * (1 - cluster.memory_reserve)
        again = estimate_memory(cfg, p.parallel, p.micro_batch_size * (p.parallel.microbatches if p.parallel.pp > 1
                                                                           else 1), 4096, flash_attention=True)
        assert again.peak == pytest.approx(p.peak_memory)
        assert ParallelConfig(**parse_parallel(p.parallel_arg())) == p.parallel


def test_impossible_cluster_says_why():
    cfg = preset("v3-671b")
    cluster = Cluster(devices=8, device_memory=80e9)
    result = search(cfg, cluster, global_batch=64, seq_len=4096)
    assert not result.plans
    message = why_nothing_fits(result, cluster)
    assert "no layout of 8 devices fits" in message and "GiB" in message
    assert "alone do not fit: add devices" in message  # 671B parameters' state on 8 x 80 GB


@pytest.mark.slow
def test_v3_on_2048_gpus_under_two_minutes():
    start = time.perf_counter()
    result = search(preset("v3-671b"), Cluster(devices=2048, device_memory=80e9), global_batch=1024, seq_len=4096)
    assert time.perf_counter() - start < 120
    assert result.plans and all(p.peak_memory <= 80e9 for p in result.plans)
