"""Group balancing across data-parallel ranks, and the gradient over 2 gloo ranks (each training its
balanced share of the groups, gradients summed) equal to the single-process gradient (fp32, 1e-6 rel)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from seekforge.rl.balance import balance_groups, imbalance
from tests.dist.dist_launcher import launch
from tests.rl.conftest import synthetic_rollout, tiny_model, weighted


def test_balance_groups_even_and_better_than_contiguous():
    rng = random.Random(0)
    tokens = [rng.choice([40, 60, 400, 600]) + rng.randint(0, 30) for _ in range(32)]
    assignment = balance_groups(tokens, 4)
    assert sorted(g for a in assignment for g in a) == list(range(32))
    assert {len(a) for a in assignment} == {8}
    contiguous = [list(range(r * 8, r * 8 + 8)) for r in range(4)]
    assert imbalance(tokens, assignment) < 1.05 < imbalance(tokens, contiguous)
    assert [len(a) for a in balance_groups([5, 1, 1, 1, 1], 2)] in ([3, 2], [2, 3])
    with pytest.raises(ValueError, match="at least 4 prompts"):
        balance_groups([1, 2], 4)


def _rank_gradient(num_prompts: int, group_size: int):
    """On each rank: the balanced share of the rollout's groups, trained with the global totals."""
    from seekforge.rl.packing import pack_sequences
    from seekforge.rl.update import LossSettings, accumulate_gradients
    from tests.rl.test_packing import grads

    prompts, completions, batch = synthetic_rollout(num_prompts, group_size)
    batch = weighted(batch, "dapo")
    group_tokens = [sum(len(prompts[i]) + len(completions[i]) for i in range(g * group_size, (g + 1) * group_size))
                    for g in range(num_prompts)]
    mine = [i for g in balance_groups(group_tokens, dist.get_world_size())[dist.get_rank()]
            for i in range(g * group_size, (g + 1) * group_size)]
    local = batch.subset(mine)
    model = tiny_model()
    rows = pack_sequences([prompts[i] for i in mine], [completions[i] for i in mine], 64, 8)
    accumulate_gradients(model, rows, local, LossSettings("dapo", beta=0.05))
    grad = grads(model)
    dist.all_reduce(grad)
    return grad


def test_gradient_over_two_gloo_ranks_equals_one_process():
    from seekforge.rl.packing import pack_sequences
    from seekforge.rl.update import LossSettings, accumulate_gradients
    from tests.rl.test_packing import grads

    prompts, completions, batch = synthetic_rollout(4, 4)
    model = tiny_model()
    accumulate_gradients(model, pack_sequences(prompts, completions, 64, 8), weighted(batch, "dapo"),
                         LossSettings("dapo", beta=0.05))
    single = grads(model)
    for grad in launch(_rank_gradient, 2, 4, 4):
        diff = (grad - single).norm() / single.norm()
        assert diff <= 1e-6, f"relative gradient difference {diff:.2e}"
    assert torch.isfinite(single).all()
