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

With the ep ranks grouped into nodes (ParallelConfig.ep_nodes > 1), HierarchicalDispatcher sends a
token across the node boundary once per destination node, then within the node, as DeepEP's internode
path does (tests/dist/test_ep_hierarchical.py counts the bytes that cross, against this flat exchange's).

Every dispatcher takes the process group of an exchange from `lane_group` when its forward builds it
(the exchange's backward reuses it): parallel/overlap.py runs two micro-batches at once, each on its
own lane of groups.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from seekforge.model.moe import MoE, weighted_sum
from seekforge.parallel.overlap import lane_group


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

    def __init__(self, group, num_experts: int, ranks_per_node: int | None = None):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local_experts = num_experts // self.ep
        # Since the last reset (probe/monitor.py reads and resets them per step): bytes this rank sent
        # to other ranks in forward (dispatch and combine), and seconds forward spent waiting on them.
        self.sent_bytes, self.wait_seconds = 0, 0.0
        # Of sent_bytes, those to ranks of other nodes, were the ep ranks grouped into nodes of
        # ranks_per_node consecutive ranks (None: one node); compared with HierarchicalDispatcher's.
        self.ranks_per_node = ranks_per_node or self.ep
        self.cross_node_bytes = 0

    def comm_groups(self) -> list:
        """The process groups it exchanges over (parallel/overlap.py makes a twin of each)."""
        return [self.group]

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, num_experts: int):
        """x (N, H), indices (N, K) → in-flight received copies (R, H), tokens per local expert (L,),
        state for wait/combine."""
        ep, num_local = self.ep, self.num_local_experts
        flat = indices.reshape(-1)  # (S,)
        order = flat.argsort(stable=True)  # by expert id, hence by owner rank (owner = id // L)
        num_tokens_per_expert = torch.bincount(flat, minlength=num_experts)  # (E,)
        recv_counts = torch.empty_like(num_tokens_per_expert)
        dist.all_to_all_single(recv_counts, num_tokens_per_expert, group=lane_group(self.group))
        recv_counts = recv_counts.view(ep, num_local)  # [source rank, local expert]
        input_splits = num_tokens_per_expert.view(ep, num_local).sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        flight = _InFlight(lane_group(self.group), input_splits, output_splits)
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
        row_bytes = rows.shape[-1] * rows.element_size()
        self.sent_bytes += (sum(splits) - splits[self.rank]) * row_bytes
        node = self.rank // self.ranks_per_node
        mine = splits[node * self.ranks_per_node:(node + 1) * self.ranks_per_node]
        self.cross_node_bytes += (sum(splits) - sum(mine)) * row_bytes

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor) -> torch.Tensor:
        """y (R, H) expert-major, weights (N, K) → (N, H)."""
        order, flight, expert_major = state
        y = torch.empty_like(y).index_copy(0, expert_major, y)  # back to (source rank, expert) order
        back = _InFlight(flight.group, flight.output_splits, flight.input_splits)  # dispatch's lane
        self._count(flight.output_splits, y)
        start = time.perf_counter()
        y = all_to_all(y, back)  # (S, H) in this rank's sorted order
        self.wait_seconds += time.perf_counter() - start
        n, k = weights.shape
        unsorted = torch.empty_like(y).index_copy(0, order, y).view(n, k, y.shape[-1])  # (N, K, H); N may be 0
        return weighted_sum(unsorted, weights)  # the same sum as LocalDispatcher.combine


class HierarchicalDispatcher:
    """Drop-in for AllToAllDispatcher with the ep ranks grouped into nodes (DeepEP's internode path).

    ep rank p = node · r + local (r ranks per node, nodes of consecutive ranks; experts stay E/ep
    contiguous ones per rank, so a node holds E/ep_nodes contiguous experts). Legend as the module's,
    plus G nodes, A = (token, node) pairs this rank sends, B rows that arrived from the rails.

    dispatch: one row per (token, destination node) goes to the rank of that node with this rank's
              local index (the rail group: one rank per node), with the ids of the token's experts on
              that node (-1 elsewhere). Rows for this rank's own node take the same path to itself, so
              they never leave the rank. The rows travel while the shared experts run; `wait` then
              expands them into copies and runs an intra-node all-to-all to the experts' owners
              (the flat dispatcher's exchange, within the node).
    combine:  outputs return within the node, are weighted (the router weights cross the rail with
              the ids) and summed per arrived row, and one row per (token, node) crosses back.
    So each direction moves rows × H across nodes with rows = A ≤ N·K, where the flat exchange
    moves one row per copy on another node. Node-limited routing bounds A: see `nodes_per_token`.
    """

    def __init__(self, group, rail_group, node_group, num_experts: int):
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.rail_group, self.node_group = rail_group, node_group
        self.nodes, self.node = dist.get_world_size(rail_group), dist.get_rank(rail_group)
        self.per_node, self.local = dist.get_world_size(node_group), dist.get_rank(node_group)
        if self.nodes * self.per_node != self.ep or self.node * self.per_node + self.local != self.rank:
            raise ValueError(f"ep rank {self.rank} of {self.ep} is (node {self.node} of {self.nodes}, local "
                             f"{self.local} of {self.per_node}): nodes must be consecutive ep ranks; build the "
                             "groups from parallel/mesh.py's ep_node × ep_local view")
        self.num_local_experts = num_experts // self.ep
        self.experts_per_node = num_experts // self.nodes
        # As AllToAllDispatcher's; cross_node_bytes counts hidden-state rows across node boundaries,
        # cross_node_meta_bytes the expert ids and router weights that travel with them.
        self.sent_bytes, self.wait_seconds, self.cross_node_bytes, self.cross_node_meta_bytes = 0, 0.0, 0, 0

    def comm_groups(self) -> list:
        return [self.rail_group, self.node_group]

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, num_experts: int):
        """x (N, H), indices (N, K) → rows crossing the rails (in flight), tokens per local expert (L,), state."""
        n, k = indices.shape
        node_of = indices // self.experts_per_node  # (N, K)
        hit = torch.zeros(n, self.nodes, dtype=torch.bool, device=x.device).scatter_(1, node_of, True)  # (N, G)
        dest, token = hit.t().nonzero(as_tuple=True)  # (A,) each: (node, token) pairs, node-major
        send = hit.sum(0)  # (G,)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=lane_group(self.rail_group))
        rail = _InFlight(lane_group(self.rail_group), send.tolist(), recv.tolist())
        on_dest = node_of[token] == dest[:, None]  # (A, K): which of the token's experts the row serves
        ids = torch.where(on_dest, indices[token], -1)
        arrived_ids = ids.new_empty(sum(rail.output_splits), k)  # (B, K)
        dist.all_to_all_single(arrived_ids, ids, rail.output_splits, rail.input_splits, group=rail.group)
        self._count(rail.input_splits, self.node, x, cross=True)
        self.cross_node_meta_bytes += (sum(rail.input_splits) - rail.input_splits[self.node]) * k * ids.element_size()
        arriving = _Start.apply(x[token], rail)  # (B, H), crossing nodes while the shared experts run
        order, flight, counts, expert_major = self._plan_node_exchange(arrived_ids)
        return arriving, counts, (n, k, dest, token, on_dest, rail, order, flight, expert_major)

    def _plan_node_exchange(self, arrived_ids: torch.Tensor):
        """arrived_ids (B, K) (-1: not this node's) → the copies' order by expert, the intra-node
        flight, tokens per local expert (L,), and the received copies' expert-major order."""
        per_node, num_local, span = self.per_node, self.num_local_experts, self.experts_per_node
        flat = arrived_ids.reshape(-1)  # (B·K,)
        valid = flat >= 0
        key = torch.where(valid, flat - self.node * span, span)  # expert within the node; others last
        order = key.argsort(stable=True)[: int(valid.sum())]  # copy positions grouped by expert
        counts = torch.bincount(key[order], minlength=span)  # (L·r,)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=lane_group(self.node_group))
        recv_counts = recv_counts.view(per_node, num_local)  # [source local rank, local expert]
        flight = _InFlight(lane_group(self.node_group), counts.view(per_node, num_local).sum(1).tolist(),
                           recv_counts.sum(1).tolist())
        segment = torch.arange(per_node * num_local, device=arrived_ids.device).repeat_interleave(
            recv_counts.reshape(-1))
        expert_major = ((segment % num_local) * per_node + segment // num_local).argsort(stable=True)
        return order, flight, recv_counts.sum(0), expert_major

    def wait(self, arriving: torch.Tensor, state) -> torch.Tensor:
        """Finish the rail exchange, then deliver the copies within the node → (R, H) expert-major."""
        _, k, _, _, _, rail, order, flight, expert_major = state
        start = time.perf_counter()
        arrived = _Wait.apply(arriving, rail)  # (B, H)
        self._count(flight.input_splits, self.local, arrived, cross=False)
        received = all_to_all(arrived[order // k], flight)
        self.wait_seconds += time.perf_counter() - start
        return received[expert_major]

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor) -> torch.Tensor:
        """y (R, H) expert-major, weights (N, K) → (N, H)."""
        n, k, dest, token, on_dest, rail, order, flight, expert_major = state
        h = y.shape[-1]
        start = time.perf_counter()
        y = torch.empty_like(y).index_copy(0, expert_major, y)  # back to (source local rank, expert) order
        self._count(flight.output_splits, self.local, y, cross=False)
        y = all_to_all(y, _InFlight(flight.group, flight.output_splits, flight.input_splits))
        arrived = sum(rail.output_splits)
        slots = y.new_zeros(arrived * k, h).index_copy(0, order, y).view(arrived, k, h)  # (B, K, H), 0: elsewhere
        w = torch.where(on_dest, weights[token], 0)  # (A, K)
        w = all_to_all(w, _InFlight(rail.group, rail.input_splits, rail.output_splits))  # (B, K)
        self.cross_node_meta_bytes += (sum(rail.input_splits) - rail.input_splits[self.node]) * k * w.element_size()
        partial = weighted_sum(slots, w)  # (B, H): each arrived row's experts on this node, summed
        self._count(rail.output_splits, self.node, partial, cross=True)
        partial = all_to_all(partial, _InFlight(rail.group, rail.output_splits, rail.input_splits))  # (A, H)
        self.wait_seconds += time.perf_counter() - start
        per_node = partial.new_zeros(self.nodes * n, h).index_copy(0, dest * n + token, partial)
        return per_node.view(self.nodes, n, h).sum(0)

    def _count(self, splits: list[int], me: int, rows: torch.Tensor, cross: bool) -> None:
        """Rows sent to other ranks of `splits`' group (all on other nodes if `cross`), in bytes."""
        sent = (sum(splits) - splits[me]) * rows.shape[-1] * rows.element_size()
        self.sent_bytes += sent
        if cross:
            self.cross_node_bytes += sent


class EtpDispatcher:
    """Expert-TP around an ep dispatcher (Megatron's expert_tensor_parallel_size): the etp ranks of one
    ep rank hold the same experts, each storing 1/etp of every expert (apply_ep) and computing its I/etp
    slice of the intermediate dim.

    They come from the data-parallel ranks, so each receives its own copies from the ep all-to-all;
    `wait` all-gathers them over the etp group (every etp rank then runs the same rows, T = Σ R_j of
    the group, expert-major), `exchange` hands each rank the gate and up columns of its own slice, and
    `combine` sums the partial down outputs over etp, each rank keeping its own rows (a reduce-scatter),
    before the ep dispatcher's combine. All are uneven all-to-alls (the R_j differ), differentiable as
    `all_to_all` is: the gather's backward sums the gradients.
    """

    def __init__(self, inner, etp_group):
        self.inner, self.group = inner, etp_group
        self.etp, self.rank = dist.get_world_size(etp_group), dist.get_rank(etp_group)
        self.routes = fused_routes(self.etp, self.rank)

    def __getattr__(self, name):  # sent_bytes, wait_seconds, ...: the ep dispatcher's counters
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "group", "etp", "rank", "routes") or "inner" not in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def comm_groups(self) -> list:
        return [*self.inner.comm_groups(), self.group]

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, num_experts: int):
        """As the ep dispatcher's, with tokens per local expert summed over the etp group (L,)."""
        received, counts, state = self.inner.dispatch(x, indices, num_experts)
        all_counts = counts.new_empty(self.etp * counts.shape[0])
        dist.all_gather_single(all_counts, counts, group=lane_group(self.group))
        all_counts = all_counts.view(self.etp, -1)  # (etp, L) [etp rank, local expert]
        rows = all_counts.sum(1).tolist()  # R_j per etp rank
        segment = torch.arange(all_counts.numel(), device=x.device).repeat_interleave(all_counts.reshape(-1))
        num_local = counts.shape[0]
        expert_major = ((segment % num_local) * self.etp + segment // num_local).argsort(stable=True)  # (T,)
        return received, all_counts.sum(0), (state, rows, expert_major)

    def wait(self, received: torch.Tensor, state) -> torch.Tensor:
        """→ the etp group's copies (T, H), expert-major."""
        inner_state, rows, expert_major = state
        mine = self.inner.wait(received, inner_state)  # (R, H)
        gather = _InFlight(lane_group(self.group), [rows[self.rank]] * self.etp, rows)
        return all_to_all(mine.repeat(self.etp, 1), gather)[expert_major]

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor) -> torch.Tensor:
        """y (T, H) partial outputs, expert-major → (N, H)."""
        inner_state, rows, expert_major = state
        y = torch.empty_like(y).index_copy(0, expert_major, y)  # back to (etp rank, expert) order
        mine = rows[self.rank]
        y = all_to_all(y, _InFlight(lane_group(self.group), rows, [mine] * self.etp))  # (etp·R, H): every rank's part
        return self.inner.combine(y.view(self.etp, mine, y.shape[-1]).sum(0), inner_state, weights)

    def exchange(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2P), P = I/etp: the first GEMM's output over this rank's stored rows of the fused
        [gate; up] weight → (T, 2P) [gate | up] of this rank's own slice (see `fused_routes`)."""
        t, p = gate_up.shape[0], gate_up.shape[1] // 2
        order, send, recv = self.routes
        pieces = gate_up.view(t, 2, p).transpose(0, 1)[order].reshape(2 * t, p)  # (2T, P) by destination rank
        mine = all_to_all(pieces, _InFlight(lane_group(self.group), [n * t for n in send], [n * t for n in recv]))
        return torch.cat((mine[:t], mine[t:]), dim=-1)  # gate arrives before up: from a lower etp rank


def fused_routes(etp: int, rank: int) -> tuple[list[int], list[int], list[int]]:
    """Where expert-TP's pieces of the fused gate_up go. The fused rows [gate; up] (2I) are 2·etp pieces
    of P = I/etp rows: piece k < etp is gate's slice k, piece etp + k up's slice k. Etp rank q stores
    rows [2qP, 2(q+1)P), the pieces 2q and 2q+1 (a contiguous Shard, what checkpoints and the Layout
    describe); slice r's owner is rank r, so piece k goes to rank k mod etp. Rank r receives gate's
    slice r from rank ⌊r/2⌋ and up's from rank ⌊(etp+r)/2⌋, a higher rank when etp > 1: all-to-all
    output is ordered by source, so gate comes first.
    → (this rank's two pieces ordered by destination, pieces sent to each rank, pieces received from each)."""
    dest = [(2 * rank) % etp, (2 * rank + 1) % etp]
    order = sorted(range(2), key=dest.__getitem__)
    send = [dest.count(d) for d in range(etp)]
    recv = [(rank // 2 == s) + ((etp + rank) // 2 == s) for s in range(etp)]
    return order, send, recv


def nodes_per_token(cfg, ep_nodes: int) -> int:
    """The most nodes one token's copies reach. Groups are contiguous ranges of E/n_group experts and a
    node holds E/ep_nodes contiguous experts, so when ep_nodes divides n_group every group lies within
    one node (group g on node g·ep_nodes/n_group) and a token, choosing within topk_group groups,
    reaches at most topk_group nodes: DeepSeek-V3's node-limited routing (M = topk_group)."""
    bound = min(cfg.num_experts_per_tok, ep_nodes)
    if cfg.n_group > 1 and cfg.topk_method != "greedy" and cfg.n_group % ep_nodes == 0:
        bound = min(bound, cfg.topk_group)
    return bound


def apply_ep(model: torch.nn.Module, ep_mesh: DeviceMesh, node_mesh: DeviceMesh | None = None,
             etp_mesh: DeviceMesh | None = None) -> None:
    """Keep E/ep experts per rank (stacked weights become DTensors sharded on the expert dim, so
    checkpoints see the global tensor) and route tokens with all-to-alls over `ep_mesh`; with
    `node_mesh` (the ep ranks as ep_node × ep_local, parallel/mesh.py) hierarchically, node to node.
    With `etp_mesh` (expert-TP: the etp × ep mesh of parallel/mesh.py's etp view, etp > 1) each etp rank
    stores 1/etp of its experts, as Megatron's expert_tensor_parallel_size: a contiguous Shard of the
    fused gate_up rows (dim 1) and of down's columns (dim 2) on the etp dim, besides the experts' Shard
    on ep. So checkpoints and the Layout see plain shards of the global tensors (any layout resumes
    any other) and FSDP shards them further over the ranks holding the same shard (dp_shard_mod_etp,
    parallelize.py), reducing the gradients there and not over etp. EtpDispatcher.exchange pairs each
    slice's gate and up columns in compute."""
    rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    etp = etp_mesh is not None and etp_mesh.size(0) > 1
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        experts = moe.experts
        for name, etp_dim in (("gate_up_proj", 1), ("down_proj", 2)):
            full = getattr(experts, name)
            local = full.detach().chunk(ep, dim=0)[rank]  # every rank built the same model
            if etp:
                local = local.chunk(etp_mesh.size(0), dim=etp_dim)[etp_mesh.get_local_rank(0)]
                sharded = DTensor.from_local(local.clone(), etp_mesh, [Shard(etp_dim), Shard(0)], run_check=False)
            else:
                sharded = DTensor.from_local(local.clone(), ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, torch.nn.Parameter(sharded, requires_grad=full.requires_grad))
        if node_mesh is None:
            moe.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), moe.cfg.n_routed_experts)
        else:
            moe.dispatcher = HierarchicalDispatcher(ep_mesh.get_group(), node_mesh["ep_node"].get_group(),
                                                    node_mesh["ep_local"].get_group(), moe.cfg.n_routed_experts)
        if etp:
            moe.dispatcher = EtpDispatcher(moe.dispatcher, etp_mesh.get_group(0))
            experts.etp_exchange = moe.dispatcher.exchange
