"""Property tests of the resharding planner (parallel/reshard.py) over random layouts of up to 8
simulated ranks: the plan reassembles every tensor exactly, moves no byte already in place, and moves
exactly the lower bound — computed here independently, with a boolean mask per destination box."""

import itertools
import math

import numpy as np
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from seekforge.parallel.layout import Layout, Placement, TensorLayout
from seekforge.parallel.reshard import gather_scatter_bytes, intersect, lower_bound_bytes, plan_bytes, plan_reshard


@st.composite
def placements(draw, shape, world):
    """One complete copy: a device matrix over some of the ranks, random shard steps."""
    ranks = draw(st.permutations(range(world)))
    dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(lambda d: math.prod(d) <= world))
    size = math.prod(dims)
    steps = []
    for mesh_dim in draw(st.permutations(range(len(dims)))):  # application order
        if draw(st.booleans()):
            steps.append((mesh_dim, draw(st.integers(0, len(shape) - 1))))
    names = tuple(f"m{i}" for i in range(len(dims)))
    return Placement(tuple(dims), names, tuple(ranks[:size]), tuple(steps))


@st.composite
def layout_pairs(draw):
    shapes = draw(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3))
    dtypes = [draw(st.sampled_from([torch.float32, torch.bfloat16])) for _ in shapes]
    layouts = []
    for _ in range(2):
        world = draw(st.integers(1, 8))
        tensors = {}
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            copies = draw(st.lists(placements(shape, world), min_size=1, max_size=2))
            tensors[f"t{i}"] = TensorLayout(shape, dtype, copies)
        layouts.append(Layout(world, tensors))
    for t in layouts[1].tensors.values():  # the planner refuses one rank holding different overlapping boxes
        for boxes in t.rank_boxes().values():
            assume(all(intersect(a, b) is None for i, a in enumerate(boxes) for b in boxes[i + 1:]))
    return layouts


def _slices(region, box):
    return tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(region, box, strict=True))


def _mask(box, shape, boxes):
    """Elements of `box` covered by any of `boxes`, as a bool array of box's size."""
    covered = np.zeros([b - a for a, b in box], dtype=bool)
    for other in boxes:
        lo = [max(a, c) for (a, _), (c, _) in zip(box, other, strict=True)]
        hi = [min(b, d) for (_, b), (_, d) in zip(box, other, strict=True)]
        if all(l < h for l, h in zip(lo, hi, strict=True)):
            covered[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box, strict=True))] = True
    return covered


@settings(max_examples=150, deadline=None)
@given(layout_pairs())
def test_plan_reassembles_exactly_with_the_fewest_bytes(pair):
    src, dst = pair
    plan = plan_reshard(src, dst)
    expected_bytes = 0
    for name, d in dst.tensors.items():
        s = src.tensors[name]
        full = torch.arange(math.prod(d.shape), dtype=torch.float64).reshape(d.shape)
        src_held = s.rank_boxes()
        # Source ranks hold exactly their boxes; destination boxes start empty (NaN), writes are counted.
        source = {(r, b): full[_slices(b, tuple((0, n) for n in d.shape))].clone()
                  for r, boxes in src_held.items() for b in boxes}
        dest = {(r, b): torch.full([hi - lo for lo, hi in b], float("nan"), dtype=torch.float64)
                for b, ranks in d.pieces().items() for r in ranks}
        writes = {k: torch.zeros(v.shape, dtype=torch.int64) for k, v in dest.items()}
        for t in (t for t in plan if t.name == name):
            assert (t.src_rank, t.src_box) in source, "a transfer reads a box its source rank does not hold"
            if t.remote:  # never move what the destination rank already holds
                assert not _mask(t.region, d.shape, src_held.get(t.dst_rank, [])).any()
            dest[t.dst_rank, t.dst_box][_slices(t.region, t.dst_box)] = source[t.src_rank, t.src_box][
                _slices(t.region, t.src_box)]
            writes[t.dst_rank, t.dst_box][_slices(t.region, t.dst_box)] += 1
            assert t.nbytes == math.prod(hi - lo for lo, hi in t.region) * s.element_size
        for (r, b), value in dest.items():
            torch.testing.assert_close(value, full[_slices(b, tuple((0, n) for n in d.shape))], rtol=0, atol=0)
            assert (writes[r, b] == 1).all(), "every element is written exactly once"
            expected_bytes += int((~_mask(b, d.shape, src_held.get(r, []))).sum()) * s.element_size
    assert plan_bytes(plan) == expected_bytes == lower_bound_bytes(src, dst)
    assert plan_bytes(plan) <= gather_scatter_bytes(src, dst)


def test_replicas_share_the_sending():
    """A tensor replicated on 4 ranks, wanted whole by 4 others: each source sends one copy."""
    shape = (8, 4)
    src = Layout(8, {"w": TensorLayout(shape, torch.float32, [Placement((4,), ("dp",), (0, 1, 2, 3))])})
    dst = Layout(8, {"w": TensorLayout(shape, torch.float32, [Placement((4,), ("dp",), (4, 5, 6, 7))])})
    plan = plan_reshard(src, dst)
    sent = {r: sum(t.nbytes for t in plan if t.src_rank == r) for r in range(4)}
    assert set(sent.values()) == {8 * 4 * 4}


def test_identical_layouts_move_nothing():
    shape = (6, 5, 3)
    p = Placement((2, 2), ("dp", "tp"), (0, 1, 2, 3), ((1, 0), (0, 0)))
    layout = Layout(4, {"w": TensorLayout(shape, torch.bfloat16, [p])})
    plan = plan_reshard(layout, layout)
    assert plan_bytes(plan) == 0 and all(not t.remote for t in plan)
    assert len(plan) == 4 and all(t.region == t.src_box == t.dst_box for t in plan)


def test_chunk_rule_matches_dtensor():
    """Uneven sizes: chunks of ⌈n/k⌉, the tail short or empty (DTensor / FSDP2)."""
    from seekforge.parallel.layout import chunk

    assert [chunk(0, 5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    sizes = [len(c) for c in torch.arange(5).tensor_split([2, 4])]
    assert sizes == [2, 2, 1]
    assert list(itertools.chain(*[range(*chunk(0, 9, 3, i)) for i in range(3)])) == list(range(9))


def test_overlapping_boxes_on_one_destination_rank_are_refused():
    import pytest

    shape = (4,)
    src = Layout(1, {"w": TensorLayout(shape, torch.float32, [Placement((1,), ("r",), (0,))])})
    dst = Layout(2, {"w": TensorLayout(shape, torch.float32, [Placement((1,), ("r",), (0,)),
                                                               Placement((2,), ("r",), (0, 1), ((0, 0),))])})
    with pytest.raises(ValueError, match="overlapping boxes"):
        plan_reshard(src, dst)


@settings(max_examples=30, deadline=None)
@given(layout_pairs(), st.integers(1, 200))
def test_rounds_respect_the_memory_cap(pair, cap):
    """Every remote transfer lands in exactly one round; per round, each rank sends + receives at most
    `cap` bytes, or takes part in one transfer only (a transfer above the cap)."""
    from seekforge.parallel.transfer import rounds

    plan = plan_reshard(*pair)
    out = rounds(plan, cap)
    assert sorted(t for r in out for t in r) == sorted(t for t in plan if t.remote)
    for r in out:
        per_rank: dict[int, list[int]] = {}
        for t in r:
            for rank in (t.src_rank, t.dst_rank):
                per_rank.setdefault(rank, []).append(t.nbytes)
        assert all(sum(sizes) <= cap or len(sizes) == 1 for sizes in per_rank.values())
