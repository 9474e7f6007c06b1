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


def test_search_explores_cp_etp_and_hierarchical_ep_within_pretrains_rules():
    from seekforge.plan.search import _layouts

    cfg = preset("small")  # 16 experts, moe_intermediate_size 256
    layouts = [pc for pc, _ in _layouts(cfg, 16, 32, 256, (1,), devices_per_node=4)]
    cps = [pc for pc in layouts if pc.cp > 1]
    assert {pc.cp for pc in cps} == {2, 4, 8, 16} and all(256 % (2 * pc.cp) == 0 for pc in cps)
    # cp composes with TP, PP and EP (which may borrow cp ranks), in bf16; not with etp or ep_nodes (ParallelConfig)
    assert all(pc.etp == pc.ep_nodes == 1 and pc.mixed_precision == "bf16" for pc in cps)
    assert {"tp", "pp", "ep"} <= {k for pc in cps for k in ("tp", "pp", "ep") if getattr(pc, k) > 1}
    assert [pc for pc in cps if pc.ep > pc.dp_shard]  # ep over dp_shard × cp
    assert all(pc.mixed_precision == "bf16" for pc in layouts)
    etps = [pc for pc in layouts if pc.etp > 1]
    assert etps and all(pc.ep > 1 and pc.ep_nodes == 1 and pc.dp_shard % (pc.ep * pc.etp) == 0 for pc in etps)
    nodes = [pc for pc in layouts if pc.ep_nodes > 1]
    assert nodes and all(pc.ep * pc.tp == 4 * pc.ep_nodes and pc.etp == 1 for pc in nodes)
    assert not [pc for pc, _ in _layouts(cfg, 16, 32, 12, (1,), 4) if pc.cp in (4, 8)]  # 12 % 8, 12 % 16
    assert {pc.cp for pc, _ in _layouts(cfg, 16, 32, 12, (1,), 4)} == {1, 2}


def test_time_model_prices_cp_etp_and_the_node_boundary():
    from seekforge.plan.search import _comm_per_microbatch, _step_time

    cfg = preset("v3-671b")
    cluster = Cluster(devices=256, device_memory=80e9, devices_per_node=8)
    tokens = 4096.0
    flat = _comm_per_microbatch(cfg, ParallelConfig(dp_shard=64, ep=64), cluster, tokens)
    nodes = _comm_per_microbatch(cfg, ParallelConfig(dp_shard=64, ep=64, ep_nodes=8), cluster, tokens)
    # node-limited routing (topk_group 4 of n_group 8, one group per node): at most 4 rows cross per
    # token, 7/8 of them to other nodes, at 50 GB/s, then 7/8 of the 8 copies within the node at 150 GB/s;
    # the flat exchange sends 63/64 of 8 copies at 50 GB/s: (3.5/50 + 7/150) / (7.875/50) = 0.74
    assert nodes["ep"] == pytest.approx(flat["ep"] * (3.5 / 50 + 7 / 150) / (7.875 / 50))
    etp = _comm_per_microbatch(cfg, ParallelConfig(dp_shard=64, ep=8, etp=2), cluster, tokens)
    assert etp["etp"] > 0 and etp["ep"] < flat["ep"]
    # gather and reduce-scatter of the copies both ways, and the gate/up exchange (half the etp=2 ranks'
    # 2·tokens·K rows, I wide: the other rank's slice) forward and backward, over 16 ranks at 50 GB/s
    copies, rows = 2.0 * tokens * cfg.num_experts_per_tok * cfg.hidden_size, 2 * tokens * cfg.num_experts_per_tok
    exchange = 2.0 * rows / 2 * cfg.moe_intermediate_size
    assert etp["etp"] == pytest.approx(cfg.num_moe_layers * (4 * copies + 2 * exchange) / 50e9)
    small = preset("small")
    one, _, t1 = _step_time(small, ParallelConfig(dp_shard=2), cluster, 1, 4, 4096)
    cp2, _, t2 = _step_time(small, ParallelConfig(dp_shard=2, cp=2), cluster, 1, 4, 4096)
    assert t2["compute"] == pytest.approx(t1["compute"] / 2) and t2["cp"] > 0


def test_ring_exposes_only_what_compute_cannot_hide():
    from seekforge.plan.search import _ring_exposed

    cfg, pc = preset("v3-671b"), ParallelConfig(dp_shard=2, cp=4, mixed_precision="bf16")
    tokens, block = 1024.0, 1024.0 * (512 + 64)  # a rank's tokens and latent elements
    bandwidth = 150e9
    last_hop = block * 4 / bandwidth  # the last fp32 gradient's way home: nothing left to hide it

    def exposed(flops):
        return _ring_exposed(cfg, pc, Cluster(devices=8, device_memory=80e9, flops=flops), tokens, 4096)

    assert exposed(1e3) == pytest.approx(last_hop)  # slow compute hides every other hop
    # no compute to speak of: 3 bf16 blocks forward, 3 bf16 blocks and fp32 gradients backward, the last hop
    assert exposed(1e30) == pytest.approx(block * (3 * 2 + 3 * 6 + 4) / bandwidth)
    assert last_hop <= exposed(400e12) <= exposed(1e30)
