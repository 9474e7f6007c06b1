"""GRPO's data-parallel collectives. Without a process group each is the one-process identity.

Under torchrun every rank has its own engine and rolls out its balanced share of the prompt groups
(rl/balance.py). The policy is either FSDP-sharded over the ranks (GRPOConfig.fsdp, the default:
parameters, gradients and optimizer state sharded; each engine generates on a full replica that every
update refreshes, rl/replica.py) or replicated (fsdp=False: every rank holds the full policy and its
optimizer state). Either way gradients are summed over ranks, never averaged: the loss weights already
divide by the whole batch's totals (rl/algorithm.sequence_weights), so the sum is the whole batch's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seekforge.parallel.fsdp import apply_fsdp
from seekforge.rl.balance import balance_groups


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main() -> bool:
    return not distributed() or dist.get_rank() == 0


def my_groups(group_work: list[int]) -> list[int]:
    """group_work[g]: group g's expected work (tokens) → the groups this rank takes, ascending."""
    if not distributed():
        return list(range(len(group_work)))
    return balance_groups(group_work, dist.get_world_size())[dist.get_rank()]


def all_groups(mine: list[int], completions: list[list[int]], values: list[list[float]], errors: int,
               num_groups: int, group_size: int) -> tuple[list[list[int]], torch.Tensor, int]:
    """This rank's groups' completions and each one's reward values (a row per completion) → every group's,
    in global order ((N, R) float64), and the reward errors summed over ranks."""
    pieces = [(mine, completions, values, errors)]
    if distributed():
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, (mine, completions, values, errors))
    all_completions: list = [None] * (num_groups * group_size)
    width = max((len(p[2][0]) for p in pieces if p[2]), default=0)  # a rank may have had no groups
    all_values = torch.zeros(num_groups * group_size, width, dtype=torch.float64)
    for groups, comps, rows, _ in pieces:
        for k, g in enumerate(groups):
            for j in range(group_size):
                all_completions[g * group_size + j] = comps[k * group_size + j]
                all_values[g * group_size + j] = torch.tensor(rows[k * group_size + j], dtype=torch.float64)
    return all_completions, all_values, sum(p[3] for p in pieces)


def all_sequences(mine: list[int], values: list[torch.Tensor], num_sequences: int) -> list[torch.Tensor]:
    """This rank's per-sequence tensors (for its sequences `mine`, indices into the step's group-major
    list) → every sequence's, in global order (each rank holds whole groups; every index is someone's)."""
    pieces = [(mine, [v.cpu() for v in values])]
    if distributed():
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, (mine, [v.cpu() for v in values]))
    out: list = [None] * num_sequences
    for indices, tensors in pieces:
        for i, value in zip(indices, tensors, strict=True):
            out[i] = value
    return out


def sum_gradients_over_ranks(model) -> None:
    """Replicated policies' gradients summed over ranks. A routed expert may get tokens on one rank
    only: it gets a (zero) gradient everywhere iff some rank has one, so the reductions line up and
    AdamW skips exactly what one process would skip."""
    if not distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    for p, any_rank in zip(params, has_grad.tolist(), strict=True):
        if any_rank:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def shard_policy(policy) -> None:
    """FSDP2 over all ranks, gradients summed rather than averaged: the loss weights already divide by
    the whole batch's totals (rl/algorithm.sequence_weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    device_type = policy.embed_tokens.weight.device.type
    apply_fsdp(policy, init_device_mesh(device_type, (dist.get_world_size(),)), MixedPrecisionPolicy())
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def first_error_over_ranks(error: tuple[str, str] | None) -> tuple[str, str] | None:
    """(what failed, message) of the first rank that has an error, where any has: every rank stops alike (a
    collective save follows), and rank 0, which prints, says what failed where."""
    if not distributed():
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next(((e[0], f"{e[1]} (on rank {rank})") for rank, e in enumerate(errors) if e is not None), None)


def max_over_ranks(value: int) -> int:
    if not distributed():
        return value
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    if not distributed():
        return values
    names = sorted(values)
    summed = torch.tensor([values[n] for n in names], dtype=torch.float64)
    dist.all_reduce(summed)
    return dict(zip(names, summed.tolist(), strict=True))
