"""`etp` (expert tensor parallelism): config checks, the --parallel parser, and the weight shards each etp
rank stores computing the whole expert. No process groups."""

import pytest
import torch

from seekforge.config import ParallelConfig, preset
from seekforge.config.parallel import parse_parallel
from seekforge.model.moe import GroupedExperts, grouped_mm, swiglu
from seekforge.parallel.ep import fused_routes
from seekforge.parallel.layout import describe_layout
from seekforge.parallel.materialize import dry_run


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


def test_etp_layout_matches_the_meta_build():
    """The described layout (what `plan` and checkpoints' layout.json use) splits experts on etp too, and a
    meta build of every rank under a fake process group holds exactly its boxes (dry_run raises otherwise)."""
    cfg, pc = preset("tiny"), ParallelConfig(dp_shard=8, ep=2, etp=2)
    for rank in range(pc.world_size):
        dry_run(cfg, pc, rank)
    tensors = describe_layout(cfg, pc).tensors
    for name, dim in (("gate_up_proj", 1), ("down_proj", 2)):
        placement = tensors[f"layers.1.mlp.experts.{name}"].placements[0].describe()
        assert placement.startswith(f"S0(ep,dp_shard_mod_etp) S{dim}(etp)"), placement


def test_parser_accepts_etp():
    pc = ParallelConfig.from_table(parse_parallel("dp_shard=8,ep=2,etp=2"))
    assert (pc.ep, pc.etp, pc.world_size) == (2, 2, 8)
    assert ParallelConfig().etp == 1


@pytest.mark.parametrize("size", [2, 3, 4])
def test_etp_shards_compute_the_whole_expert(size):
    """Each etp rank stores a contiguous 1/size of the fused gate_up rows and of down's columns (apply_ep);
    the first GEMM's pieces routed by fused_routes (an all-to-all, simulated here) give every rank the
    gate and up columns of its own slice, and the partial outputs sum to the unsplit experts' output."""
    torch.manual_seed(0)
    inter = 12
    experts = GroupedExperts(3, 16, inter)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, counts = torch.randn(10, 16), torch.tensor([4, 0, 6])
    whole = experts(x, counts)
    p = inter // size
    routes = [fused_routes(size, q) for q in range(size)]
    outbox = []  # outbox[q][r]: rows rank q sends rank r
    for q, (order, send, _) in enumerate(routes):
        stored = experts.gate_up_proj.chunk(size, dim=1)[q]  # (E, 2P, H): fused rows [2qP, 2(q+1)P)
        pieces = grouped_mm(x, stored, counts).view(10, 2, p).transpose(0, 1)[order].reshape(20, p)
        outbox.append(pieces.split([n * 10 for n in send]))
    parts = []
    for r, (_, _, recv) in enumerate(routes):
        assert recv == [len(outbox[q][r]) // 10 for q in range(size)]
        mine = torch.cat([outbox[q][r] for q in range(size)])  # (2·10, P) by source rank: gate, then up
        gate_up = torch.cat((mine[:10], mine[10:]), dim=-1)
        torch.testing.assert_close(gate_up[:, :p], grouped_mm(x, experts.gate_up_proj[:, r * p:(r + 1) * p], counts))
        parts.append(grouped_mm(swiglu(gate_up), experts.down_proj.chunk(size, dim=2)[r], counts))
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
