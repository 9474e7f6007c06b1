"""`ep_nodes` (the hierarchical expert all-to-all's node count): config checks, the --parallel parser,
the node-limited routing bound, and `seekforge plan` taking (and ignoring) the key. No process groups."""

import pytest
import torch

from seekforge.config import ParallelConfig, preset
from seekforge.config.parallel import parse_parallel
from seekforge.model.moe import select_experts
from seekforge.parallel.ep import nodes_per_token


@pytest.mark.parametrize("layout, message", [
    (dict(dp_shard=4, ep=4, ep_nodes=3), r"ep_nodes=3 does not divide ep=4: .* pick ep_nodes in \[1, 2, 4\]"),
    (dict(ep_nodes=2), r"ep_nodes=2 does not divide ep=1"),
    (dict(dp_shard=4, ep=4, ep_nodes=0), r"ep_nodes=0: must be a positive integer"),
])
def test_ep_nodes_checks(layout, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**layout)


def test_parser_and_table_accept_ep_nodes():
    pc = ParallelConfig.from_table(parse_parallel("dp_shard=8,ep=8,ep_nodes=2"))
    assert (pc.ep, pc.ep_nodes, pc.world_size) == (8, 2, 8)
    assert ParallelConfig().ep_nodes == 1


def test_node_limited_routing_bound():
    """Groups are contiguous expert ranges, so with ep_nodes | n_group a group lies in one node and a
    token reaches at most topk_group nodes; the router's choices (unchanged) respect that."""
    cfg = preset("small")  # 16 experts, K=4, n_group=4, topk_group=2
    assert nodes_per_token(cfg, 4) == 2 and nodes_per_token(cfg, 2) == 2
    assert nodes_per_token(cfg, 8) == 4  # 8 nodes split groups: only K bounds it
    assert nodes_per_token(preset("tiny"), 2) == 1  # tiny: topk_group=1 of 2 groups
    scores = torch.rand(64, cfg.n_routed_experts, generator=torch.Generator().manual_seed(0))
    indices = select_experts(scores, torch.zeros(cfg.n_routed_experts), cfg)
    for ep_nodes in (2, 4):
        node = indices // (cfg.n_routed_experts // ep_nodes)
        reached = torch.zeros(64, ep_nodes, dtype=torch.bool).scatter_(1, node, True).sum(1)
        assert int(reached.max()) <= nodes_per_token(cfg, ep_nodes)


def test_plan_memory_takes_ep_nodes(capsys):
    """plan's cost model ignores ep_nodes (it prices the flat exchange), but must not refuse it."""
    from seekforge.cli import main

    main(["plan", "memory", "--preset", "tiny", "--parallel", "dp_shard=4,ep=4,ep_nodes=2", "--micro-batch-size",
          "2", "--seq-len", "16"])
    assert "peak" in capsys.readouterr().out
