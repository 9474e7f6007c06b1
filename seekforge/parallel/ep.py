"""Expert parallelism: each rank of the ep group holds E/ep experts; token copies travel to them and
back with two uneven all-to-alls per MoE layer (dropless: split sizes are whatever the router chose).

Shape legend: N local tokens, K experts per token, E routed experts, L = E/ep local experts,
S = N·K copies sent by this rank, R copies received by this rank, H hidden.

Per layer, forward:
  1. counts:   all_to_all of the (E,) per-expert copy counts → recv_counts (ep, L). Blocking, once per
               layer; the split sizes derived from it are reused by every later exchange, backward too.
  2. dispatch: copies sorted by expert (hence by owner rank) go out, async. MoE.forward runs the
               shared experts while they travel, then `wait` finishes the exchange.
  3. experts:  received copies are regrouped from (source rank, expert) order to (expert, source
               rank) order for one grouped GEMM.
  4. combine:  the outputs return along the reverse splits; the local weighted sum follows.
Backward mirrors this with the saved splits. `_Wait.backward` starts the gradient exchange and
`_Start.backward` finishes it and returns the result. Autograd runs the ready node recorded latest
first, so the shared experts' backward (recorded between start and wait) runs while the dispatch
gradients are in flight. tests/dist/test_ep_dropless.py checks this ordering.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from seekforge.model.moe import MoE, weighted_sum


class _InFlight:
    """The handle of one asynchronous all-to-all, shared by the _Start/_Wait pair of autograd nodes."""

    def __init__(self, group, input_splits: list[int], output_splits: list[int]):
        self.group, self.input_splits, self.output_splits = group, input_splits, output_splits
        self.work = None
        self.send = None  # keeps the send buffer alive until the exchange completes
        self.received = None

    def start(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        self.send = x.contiguous()
        self.received = x.new_empty(sum(output_splits), *x.shape[1:])
        self.work = dist.all_to_all_single(self.received, self.send, output_splits, input_splits,
                                           group=self.group, async_op=True)
        return self.received

    def wait(self) -> torch.Tensor:
        self.work.wait()
        received = self.received
        self.work = self.send = self.received = None
        return received


class _Start(torch.autograd.Function):
    """Forward: start sending x (rows split by input_splits). Backward: finish the gradient exchange
    that `_Wait.backward` started."""

    @staticmethod
    def forward(ctx, x, flight: _InFlight):
        ctx.flight = flight
        return flight.start(x, flight.output_splits, flight.input_splits)

    @staticmethod
    def backward(ctx, placeholder):
        return ctx.flight.wait(), None  # the gradient exchange _Wait.backward started


class _Wait(torch.autograd.Function):
    """Forward: finish the exchange `_Start` began. Backward: start the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, received, flight: _InFlight):
        ctx.flight = flight
        flight.wait()
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.start(grad, flight.input_splits, flight.output_splits)
        return grad, None  # a placeholder for _Start.backward, which returns the exchanged gradient


def all_to_all(x: torch.Tensor, flight: _InFlight) -> torch.Tensor:
    """A synchronous, differentiable uneven all-to-all along `flight`'s splits."""
    return _Wait.apply(_Start.apply(x, flight), flight)


class AllToAllDispatcher:
    """Drop-in for moe.LocalDispatcher across an expert-parallel process group."""

    def __init__(self, group, num_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local_experts = num_experts // self.ep
        # Since the last reset (probe/monitor.py reads and resets them per step): bytes this rank sent
        # to other ranks in forward (dispatch and combine), and seconds forward spent waiting on them.
        self.sent_bytes, self.wait_seconds = 0, 0.0

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, num_experts: int):
        """x (N, H), indices (N, K) → in-flight received copies (R, H), tokens per local expert (L,),
        state for wait/combine."""
        ep, num_local = self.ep, self.num_local_experts
        flat = indices.reshape(-1)  # (S,)
        order = flat.argsort(stable=True)  # by expert id, hence by owner rank (owner = id // L)
        num_tokens_per_expert = torch.bincount(flat, minlength=num_experts)  # (E,)
        recv_counts = torch.empty_like(num_tokens_per_expert)
        dist.all_to_all_single(recv_counts, num_tokens_per_expert, group=self.group)
        recv_counts = recv_counts.view(ep, num_local)  # [source rank, local expert]
        input_splits = num_tokens_per_expert.view(ep, num_local).sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        flight = _InFlight(self.group, input_splits, output_splits)
        self._count(input_splits, x)
        received = _Start.apply(x[order // indices.shape[1]], flight)  # (R, H), filling asynchronously
        # Received rows come grouped by (source rank, local expert); the grouped GEMM wants expert-major.
        segment = torch.arange(ep * num_local, device=x.device).repeat_interleave(recv_counts.reshape(-1))
        expert_major = ((segment % num_local) * ep + segment // num_local).argsort(stable=True)  # (R,)
        return received, recv_counts.sum(0), (order, flight, expert_major)

    def wait(self, received: torch.Tensor, state) -> torch.Tensor:
        _, flight, expert_major = state
        start = time.perf_counter()
        received = _Wait.apply(received, flight)
        self.wait_seconds += time.perf_counter() - start
        return received[expert_major]

    def _count(self, splits: list[int], rows: torch.Tensor) -> None:
        """Rows sent to other ranks (a rank's own split never leaves it), in bytes."""
        self.sent_bytes += (sum(splits) - splits[self.rank]) * rows.shape[-1] * rows.element_size()

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor) -> torch.Tensor:
        """y (R, H) expert-major, weights (N, K) → (N, H)."""
        order, flight, expert_major = state
        y = torch.empty_like(y).index_copy(0, expert_major, y)  # back to (source rank, expert) order
        back = _InFlight(self.group, flight.output_splits, flight.input_splits)
        self._count(flight.output_splits, y)
        start = time.perf_counter()
        y = all_to_all(y, back)  # (S, H) in this rank's sorted order
        self.wait_seconds += time.perf_counter() - start
        n, k = weights.shape
        unsorted = torch.empty_like(y).index_copy(0, order, y).view(n, k, y.shape[-1])  # (N, K, H); N may be 0
        return weighted_sum(unsorted, weights)  # the same sum as LocalDispatcher.combine


def apply_ep(model: torch.nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep E/ep experts per rank (stacked weights become DTensors sharded on the expert dim, so
    checkpoints see the global tensor) and route tokens with all-to-alls over `ep_mesh`."""
    rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        experts = moe.experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach().chunk(ep, dim=0)[rank].clone()  # every rank built the same model
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, torch.nn.Parameter(sharded, requires_grad=full.requires_grad))
        moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), moe.cfg.n_routed_experts)
