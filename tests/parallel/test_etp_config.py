"""`etp` (expert tensor parallelism): config checks, the --parallel parser, and the weight slices each etp
rank computes with summing to the whole expert. No process groups."""

import pytest
import torch

from seekforge.config import ParallelConfig, preset
from seekforge.config.parallel import parse_parallel
from seekforge.model.moe import GroupedExperts, intermediate_slice


@pytest.mark.parametrize("layout, message", [
    (dict(dp_shard=4, etp=2), r"etp=2 needs ep > 1"),
    (dict(dp_shard=4, ep=2, etp=3), r"ep\*etp = 2\*3 = 6 does not divide dp_shard=4: .* pick etp in \[1, 2\]"),
    (dict(dp_shard=4, ep=4, etp=2), r"ep\*etp = 4\*2 = 8 does not divide dp_shard=4"),
    (dict(dp_shard=8, ep=4, ep_nodes=2, etp=2), r"etp=2 with ep_nodes=2 is not supported"),
    (dict(dp_shard=4, ep=2, etp=0), r"etp=0: must be a positive integer"),
])
def test_etp_checks(layout, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**layout)


def test_etp_must_divide_moe_intermediate_size():
    cfg = preset("tiny")  # moe_intermediate_size 32
    ParallelConfig(dp_shard=8, ep=2, etp=4).validate(8, cfg)
    with pytest.raises(ValueError, match=r"etp=3 does not divide moe_intermediate_size=32"):
        ParallelConfig(dp_shard=6, ep=2, etp=3).validate(6, cfg)


def test_parser_accepts_etp():
    pc = ParallelConfig.from_table(parse_parallel("dp_shard=8,ep=2,etp=2"))
    assert (pc.ep, pc.etp, pc.world_size) == (2, 2, 8)
    assert ParallelConfig().etp == 1


@pytest.mark.parametrize("size", [2, 4])
def test_etp_slices_sum_to_the_whole_expert(size):
    """Each rank's gate and up columns (not a slice of the stacked gate_up) and down rows: the partial
    outputs sum to the unsplit experts' output."""
    torch.manual_seed(0)
    experts = GroupedExperts(3, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, counts = torch.randn(10, 16), torch.tensor([4, 0, 6])
    whole = experts(x, counts)
    parts = []
    for rank in range(size):
        experts.etp_slice = (rank, size)
        parts.append(experts(x, counts))
        gate_up, down = intermediate_slice(experts.gate_up_proj, experts.down_proj, rank, size)
        assert gate_up.shape == (3, 16 // size, 16) and down.shape == (3, 16, 8 // size)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
