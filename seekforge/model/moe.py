"""DeepSeekMoE: router math and dropless dispatch.

Shape legend: N tokens (batch × sequence flattened), H hidden, E routed experts, K experts per token,
I expert intermediate size, S = N·K routed token copies.

Dropless means no capacity factor: every token copy reaches its expert. Copies are sorted by expert
id (`LocalDispatcher.dispatch`), run through one grouped GEMM per projection (`GroupedExperts`), and
scattered back weighted by the router (`LocalDispatcher.combine`). parallel/ep.py swaps the dispatcher
for an all-to-all one whose `dispatch` returns with the exchange still in flight and whose `wait`
finishes it; the shared experts run in between. The experts and the router do not change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from seekforge.config import ModelConfig
from seekforge.model import kernels
from seekforge.model.dtensor import local_tensor
from seekforge.model.gpu import gpu_path, triton_ready
from seekforge.model.gpu.fused_moe import fused_moe
from seekforge.model.kernels import Linear
from seekforge.model.precision import onednn_size, uses_onednn

# GroupedExperts.forward_batched's padded rows at most this many times the real ones. Where oneDNN runs the mms
# (CPU bf16/fp16) its per-call cost lets one padded bmm beat the per-expert loop even at several times the rows;
# where MKL does (CPU fp32, measured on AMX and AVX2 CPUs) the loop wins beyond a little padding. Measured at
# decode and prefill sizes when these were set (git log -S MAX_BATCHED_PADDING).
MAX_BATCHED_PADDING = 4
MAX_BATCHED_PADDING_FP32 = 1.5
# MoE._routed_inference's fused-MoE kernels (gpu/fused_moe.py) for batches up to this many tokens: decode sizes,
# where a tile of BLOCK_M copies per expert wastes little and one launch per projection beats the sort, gathers
# and grouped GEMM around them. Beyond it (prefill chunks) every expert gets many copies, the padding and
# bookkeeping saved are a small share, and torch._grouped_mm's tuned GEMMs are as good or better.
MAX_FUSED_MOE_TOKENS = 512


class MLP(nn.Module):
    """SwiGLU feed-forward, down(silu(gate(x)) · up(x)): the dense layers' FFN and the shared experts."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) · up (..., I); with `up` None, of the two halves of `gate` (..., 2I), the stacked
    experts' gate_up output. With autograd it runs as `_SwiGLU`: the same values and gradients."""
    plain = type(gate) is torch.Tensor and not torch.compiler.is_compiling()  # not a DTensor (TP), not traced
    if plain and torch.is_grad_enabled() and (gate.requires_grad or (up is not None and up.requires_grad)):
        return _SwiGLU.apply(gate, up)
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """`F.silu(gate) * up` with the same ops in the same dtype (so equal bit for bit), in fewer passes
    and bytes: it saves only its inputs (autograd's version also keeps silu(gate) alive until backward,
    one (..., I) tensor per layer), and for a packed gate_up (..., 2I) it writes both halves' gradients
    into one buffer (autograd's chunk backward concatenates them: one more pass over (..., 2I))."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        ctx.packed = up is None
        if up is None:
            gate, up = gate.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        if ctx.packed:
            grad_packed = torch.empty_like(gate, memory_format=torch.contiguous_format)  # (..., 2I)
            (gate, up), (grad_gate, grad_up) = gate.chunk(2, dim=-1), grad_packed.chunk(2, dim=-1)
        else:
            grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        torch.mul(grad, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return (grad_packed, None) if ctx.packed else (grad_gate, grad_up)


class Gate(nn.Module):
    """Router. DeepSeek-V3: sigmoid scores, group-limited top-k chosen on scores + bias, weights from
    the unbiased scores (the bias steers selection only, so it never enters the gradient)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # Aux-loss-free balancing state, updated outside autograd by train/balance.py.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, H) → weights (N, K) fp32, indices (N, K) int64, scores (N, E) fp32."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # routing in fp32, as DeepSeek does
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        indices = select_experts(scores, self.e_score_correction_bias, cfg)
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob:  # also for top-1 (weight 1), as DeepSeek-V3's inference code and HF do
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, indices, scores


def select_experts(scores: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Group-limited top-k. Returns (N, K) expert ids. Pure function of its inputs."""
    n, e = scores.shape
    choice = scores + bias if cfg.topk_method == "noaux_tc" else scores
    if cfg.n_group > 1 and cfg.topk_method != "greedy":
        grouped = choice.view(n, cfg.n_group, e // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, n_group)
        else:
            group_scores = grouped.amax(dim=-1)
        top_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        # masked on the grouped view: repeat_interleave of the mask cost as much as the rest of the router
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
    return choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices


class LocalDispatcher:
    """Single-device dispatch: sort token copies by expert, and undo it."""

    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, num_experts: int):
        """x (N, H), indices (N, K) → sorted copies (S, H), tokens per expert (E,), state for combine."""
        flat = indices.reshape(-1)  # (S,)
        order = flat.argsort(stable=True)  # copy positions grouped by expert
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        num_tokens_per_expert = count_per_expert(flat, num_experts)
        token_of_copy = order // indices.shape[1]
        return gather_copies(x, token_of_copy, inverse, indices.shape[1]), num_tokens_per_expert, (order, inverse)

    def wait(self, routed: torch.Tensor, state) -> torch.Tensor:
        return routed  # nothing in flight on one device

    def combine(self, y: torch.Tensor, state, weights: torch.Tensor) -> torch.Tensor:
        """y (S, H) in expert order, weights (N, K) → (N, H) = Σ_k weight · expert output."""
        order, inverse = state
        n, k = weights.shape
        unsorted = gather_copies(y, inverse, order, 1).view(n, k, -1)  # back to (token, k) order
        return weighted_sum(unsorted, weights)


def count_per_expert(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """flat (S,) expert ids → (E,) int64 copies per expert: bincount, which on the GPU path would read the ids'
    maximum on the host (a sync) to size its output, so there a scatter-add of ones into E zeros."""
    if gpu_path(flat):
        counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
        return counts.scatter_add_(0, flat, torch.ones_like(flat))
    return torch.bincount(flat, minlength=num_experts)


def weighted_sum(unsorted: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """unsorted (N, K, H) expert outputs in (token, k) order, weights (N, K) → (N, H).

    A broadcast multiply and a sum over k: einsum's batched (1, K) @ (K, H) bmm, forward and
    backward, was several times slower on CPU. The products round to the outputs' dtype before the
    (fp32-accumulated) sum."""
    return (unsorted * weights.to(unsorted.dtype).unsqueeze(-1)).sum(dim=1)


class _GatherCopies(torch.autograd.Function):
    """x.index_select(0, index) where the output rows are copies of x's rows, copy (n, j) of row n
    sitting at row inverse[n·k + j]: every row of x copied exactly k times. autograd's own backward
    for x[index] is a scattered accumulate (index_put_, serial on CPU: slow at training sizes); knowing
    where the copies are makes it a gather plus a sum over the k copies."""

    @staticmethod
    def forward(ctx, x, index, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad_x = grad.index_select(0, inverse)
        if ctx.k > 1:
            grad_x = grad_x.view(-1, ctx.k, grad.shape[-1]).sum(dim=1)  # (N, K, H) → (N, H)
        return grad_x, None, None, None


def gather_copies(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """x (N, H) → x[index] (N·k, H), with `inverse` the inverse permutation of index's copies (see
    _GatherCopies); equal to x[index] in value and gradient."""
    return _GatherCopies.apply(x, index, inverse, k)


class GroupedExperts(nn.Module):
    """All routed experts as stacked weights (HF's internal layout): one GEMM per projection."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))  # (E, 2I, H)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))  # (E, H, I)
        # Under expert-TP (parallel/ep.py's apply_ep) the weights are this rank's contiguous 1/etp of the fused
        # gate_up rows and of down's columns, and this maps the first GEMM's output over the stored fused rows
        # (S, 2I/etp) to [gate | up] of the rank's own I/etp slice (an exchange within the etp group: a
        # contiguous share of [gate; up] holds other ranks' halves). None: no expert-TP.
        self.etp_exchange: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (S, H) sorted by expert → (S, H). parallel/ep.py stores the stacked weights as DTensors
        sharded over experts; the GEMMs run on this rank's experts (the dispatcher brought their tokens)."""
        gate_up_w, down_w = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        gate_up = grouped_mm(x, gate_up_w, num_tokens_per_expert)  # (S, 2I); expert-TP: (S, 2I/etp), stored rows
        if self.etp_exchange is not None:
            gate_up = self.etp_exchange(gate_up)  # (S, 2I/etp): [gate | up] of this rank's I/etp slice
        return grouped_mm(swiglu(gate_up), down_w, num_tokens_per_expert)  # expert-TP: partial sums over etp

    def forward_one_token(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Decoding one token without autograd: x (1, H), router weights and indices (1, K) → the weighted
        sum of its K experts' outputs (1, H), straight through the chosen experts' weights — the same mms
        and the same weighted sum as dispatch → forward → combine, without the sort, the two gathers and
        the per-expert row bookkeeping around them (a large share of a MoE layer's time at batch 1)."""
        if kernels.ready() and kernels.linear_takes(x, self.gate_up_proj[0]):
            # the few-rows kernel, reading the chosen experts' weights in place: one call per projection
            chosen, k = indices[0], indices.shape[1]
            act = swiglu(kernels.linear_indexed(x.expand(k, -1)[:, None], self.gate_up_proj, chosen))  # (K, 1, I)
            return weighted_sum(kernels.linear_indexed(act, self.down_proj, chosen).view(1, k, -1), weights)
        if torch.compiler.is_compiling():
            return self._one_token_traced(x, weights, indices)
        chosen = indices[0].tolist()
        gate_up = x.new_empty(len(chosen), self.gate_up_proj.shape[1])  # (K, 2I)
        for j, e in enumerate(chosen):
            torch.mm(x, self.gate_up_proj[e].t(), out=gate_up[j:j + 1])
        act = swiglu(gate_up)  # (K, I): one silu and one mul for all K experts
        outs = x.new_empty(len(chosen), self.down_proj.shape[1])  # (K, H) in (token, k) order
        for j, e in enumerate(chosen):
            torch.mm(act[j:j + 1], self.down_proj[e].t(), out=outs[j:j + 1])
        return weighted_sum(outs[None], weights)

    def _one_token_traced(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """forward_one_token as torch.compile traces it (serve/compiled.py) where our kernels do not run: each
        chosen expert id becomes a traced integer (dynamo's capture_scalar_outputs), so its weights stay views,
        read once by the mm, where indexing the stacked weights with the ids would copy the K experts' matrices
        every token."""
        num_experts = self.gate_up_proj.shape[0]
        chosen = []
        for j in range(indices.shape[1]):
            e = indices[0, j].item()
            torch._check(e >= 0)
            torch._check(e < num_experts)
            chosen.append(e)
        act = swiglu(torch.cat([F.linear(x, self.gate_up_proj[e]) for e in chosen]))  # (K, I)
        outs = torch.cat([F.linear(act[j:j + 1], self.down_proj[e]) for j, e in enumerate(chosen)])  # (K, H)
        return weighted_sum(outs[None], weights)

    def forward_batched(self, x: torch.Tensor, weights: torch.Tensor, slots: ExpertSlots) -> torch.Tensor:
        """Inference without autograd on CPU: x (N, H), router weights (N, K) and the copies' slots → the
        weighted sum of each token's K experts' outputs (N, H), as dispatch → forward → combine computes it.
        Each copy sits in its slot of an (E, C, H) batch, the other rows zero, and each projection is one bmm
        over all the experts: at decode sizes the per-expert loop of mms is slower, by oneDNN's per-call cost
        in bf16 and by MKL's small-row mms in fp32 (see MAX_BATCHED_PADDING)."""
        n, k = weights.shape
        e, h = self.down_proj.shape[:2]
        rows = x.new_zeros(e * slots.cap, h)
        rows.index_copy_(0, slots.index, x.repeat_interleave(k, dim=0))  # copy (n, j) of token n → its slot
        gate_up = torch.bmm(rows.view(e, slots.cap, h), self.gate_up_proj.transpose(1, 2))  # (E, C, 2I)
        out = torch.bmm(swiglu(gate_up), self.down_proj.transpose(1, 2)).view(e * slots.cap, h)
        return weighted_sum(out.index_select(0, slots.index).view(n, k, h), weights)


class ExpertSlots:
    """Where each token copy sits in an (E, C) batch of per-expert rows: the j-th copy routed to expert e
    (in copy order) at row e·C + j of `index`; C (`cap`) is onednn_size of the busiest expert's count, so
    that oneDNN builds kernels for a bounded set of shapes."""

    def __init__(self, flat: torch.Tensor, counts: torch.Tensor, cap: int):
        order = flat.argsort(stable=True)
        expert = flat[order]
        rank = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[expert]
        self.cap = cap
        self.index = torch.empty_like(flat).scatter_(0, order, expert * cap + rank)

    @classmethod
    def traced(cls, indices: torch.Tensor, num_experts: int, onednn_shapes: bool) -> ExpertSlots:
        """The slots as torch.compile traces them (serve/compiled.py): the cap from tensor ops, then one traced
        integer; always the batch, however skewed the routing (the choice `within` makes depends on the
        counts). At least 2: inductor's bmm lowering cannot yet decide whether a traced size is 1. The counts
        by comparison, not `bincount`: inductor fuses that into a kernel of its own, where `bincount`, having no
        C shim, ran through its proxy executor (and warned so at each compile)."""
        flat = indices.reshape(-1)
        counts = (flat[:, None] == torch.arange(num_experts, device=flat.device)).sum(0)  # (E,)
        busiest = counts.max().clamp(min=2)
        if onednn_shapes:  # onednn_size in tensor ops: above 64, up to a multiple of 1/8 of the power of two below
            step = torch.where(busiest > 64, torch.exp2(busiest.float().log2().floor() - 3).long(), 1)
            busiest = (busiest + step - 1) // step * step
        cap = busiest.item()
        torch._check(cap >= 2)
        torch._check(cap <= 2 * flat.numel())
        return cls(flat, counts, cap)

    @classmethod
    def within(cls, indices: torch.Tensor, num_experts: int, max_padding: float) -> ExpertSlots | None:
        """The slots of indices' (N, K) copies, or None where the batch would hold more than max_padding
        rows per copy."""
        flat = indices.reshape(-1)  # (S,)
        counts = torch.bincount(flat, minlength=num_experts)
        cap = onednn_size(int(counts.max()))
        return cls(flat, counts, cap) if cap * num_experts <= max_padding * flat.numel() else None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x, grouped by `counts`, times the transposed weight of their group: x_g @ W_gᵀ.

    `torch._grouped_mm` does this in one kernel, with the groups' offsets on the device (no sync); it needs
    16-byte aligned rows and a matching dtype, otherwise the exact per-expert loop runs (`grouped_mm_reference`,
    which reads the counts on the host). On CPU the loop runs as `_ExpertLoopMM` (the same mms, fewer copies
    around them); the GPU path (model/gpu) takes `torch._grouped_mm` on a CPU too.
    """
    if x.device.type == "cpu" and not gpu_path(x) and not torch.compiler.is_compiling():
        if torch.is_autocast_enabled("cpu"):
            # Cast the stacked weight once (one (E, O, I) copy, and one cast of its gradient in
            # backward) instead of autocast casting each expert's slice at each mm, both ways.
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
        elif x.dtype != weight.dtype:
            return grouped_mm_reference(x, weight, counts)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _ExpertLoopMM.apply(x, weight, counts.tolist())
        return expert_loop_mm(x, weight, counts.tolist())  # serving: no autograd.Function to enter
    if torch.is_autocast_enabled(x.device.type):  # _grouped_mm is not an autocast op: cast it the one time here
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    if _grouped_mm_ok(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x.contiguous(), weight.transpose(-2, -1), offs=offsets)
    return grouped_mm_reference(x, weight, counts)


def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    counts = counts.tolist()
    # Iterating `weight` unbinds it once (one stacked gradient in backward); experts that received
    # no tokens are skipped — at decode batch sizes most of them.
    outs = [c @ w.t() for c, w, n in zip(x.split(counts), weight, counts, strict=True) if n]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[-2])


class _ExpertLoopMM(torch.autograd.Function):
    """grouped_mm_reference's per-expert mms, each writing straight into its rows of one output (and,
    in backward, into its slice of the stacked weight gradient): autograd's version pays a cat of the
    outputs, a cat of the split input gradients and a stack of the per-expert weight gradients.
    x (S, I) sorted by expert, weight (E, O, I), counts: python ints summing to S → (S, O)."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        x, counts, rows = _as_run(x, counts)  # saved as run: padded where the mms run padded
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.rows = counts, rows
        out = _loop_mm(x, weight, counts)
        return rows.unpad(out) if rows is not None else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = ctx.rows
        grad = rows.pad(grad) if rows is not None else grad.contiguous()  # zero rows: no weight gradient
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x)
            for part, w in _expert_rows(ctx.counts, weight):
                torch.mm(grad[part], w, out=grad_x[part])  # (n, O) @ (O, I)
            if rows is not None:
                grad_x = rows.unpad(grad_x)
        if ctx.needs_input_grad[1]:
            grad_w = torch.empty_like(weight)
            for e, (part, _) in enumerate(_expert_rows(ctx.counts, weight, skip_empty=False)):
                torch.mm(grad[part].t(), x[part], out=grad_w[e])  # (O, n) @ (n, I); zeros when n = 0
        return grad_x, grad_w, None


def expert_loop_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """_ExpertLoopMM's forward: x (S, I) sorted by expert, weight (E, O, I) → (S, O), one mm per expert
    that received tokens, each written straight into its rows."""
    x, counts, rows = _as_run(x, counts)
    out = _loop_mm(x, weight, counts)
    return rows.unpad(out) if rows is not None else out


def _as_run(x: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int], BucketedRows | None]:
    """x's rows and counts as the expert mms run them: contiguous, zero-padded where oneDNN runs them
    (BucketedRows; None when not padded)."""
    rows = BucketedRows.for_mm(x, counts)
    return (x.contiguous(), counts, None) if rows is None else (rows.pad(x), rows.padded_counts, rows)


def _loop_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[1])
    with torch.autocast("cpu", enabled=False):  # out= is refused under autocast
        for part, w in _expert_rows(counts, weight):
            torch.mm(x[part], w.t(), out=out[part])
    return out


def _expert_rows(counts, weight, skip_empty=True):
    start = 0
    for n, w in zip(counts, weight, strict=True):
        if n or not skip_empty:
            yield slice(start, start + n), w
        start += n


class BucketedRows:
    """Each expert's rows zero-padded to `precision.onednn_size` of their count, for the CPU matmuls that
    oneDNN runs (bf16, fp16), which build a kernel per new shape: routing gives every expert a new row
    count every step, and a bf16 training step spent most of its expert time building kernels (the same
    expert forward ran several times faster replayed with shapes oneDNN had seen). The zero rows add
    nothing to a weight gradient, and their outputs are dropped."""

    def __init__(self, counts: list[int], padded_counts: list[int]):
        self.counts, self.padded_counts = counts, padded_counts

    @classmethod
    def for_mm(cls, x: torch.Tensor, counts: list[int]) -> BucketedRows | None:
        """The padding for x's mms, or None where none is needed (not oneDNN, or every count a bucket)."""
        if not uses_onednn(x.device, x.dtype):
            return None
        padded = [onednn_size(n) for n in counts]
        return cls(counts, padded) if padded != counts else None

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """(S, D) rows by expert → (Σ padded, D): each expert's rows, then its zero rows."""
        zeros = t.new_zeros(max(m - n for n, m in zip(self.counts, self.padded_counts, strict=True)), t.shape[1])
        pieces, start = [], 0
        for n, m in zip(self.counts, self.padded_counts, strict=True):
            pieces += [t[start:start + n], zeros[:m - n]]
            start += n
        return torch.cat(pieces)

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """pad's inverse: the real rows of each expert, back to back."""
        pieces, start = [], 0
        for n, m in zip(self.counts, self.padded_counts, strict=True):
            pieces.append(t[start:start + n])
            start += m
        return torch.cat(pieces)


def _grouped_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.device.type == "cpu" and not gpu_path(x):
        # torch's CPU _grouped_mm runs each group as an mm into a strided slice of the output, well
        # below plain mm speed (torch 2.13, bf16); the per-expert loop of plain mms is faster for a
        # whole MoE layer forward + backward (train_step.py's transformers:grouped_mm row, BENCHMARKS.md).
        return False
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[0] == 0:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # torch 2.13's meta kernel, used while tracing, accepts only bf16
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and weight.shape[-2] % align == 0


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size) if cfg.n_shared_experts else None
        )
        self.dispatcher = LocalDispatcher()
        # Token counts since the last balance update (summed over micro-batches), read by the trainer.
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_routed_experts, dtype=torch.long),
                             persistent=False)
        # The sequence-wise balance loss: its weight α, and d(step loss)/d(this layer's aux loss) — the
        # trainer's 1/(grad_accum · pipeline micro-batches), the factor every other loss term gets.
        self.aux_loss_coeff, self.aux_grad_scale = 0.0, 1.0
        # Its detached value summed over the forward passes since the trainer last read it (for logs).
        self.aux_loss: torch.Tensor | float = 0.0
        # Context parallelism: sums the per-row expert counts over the ranks holding the rows' other chunks
        # (parallel/cp.py's RowCounts); None when this rank holds whole rows.
        self.row_counts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, H)
        weights, indices, scores = self.gate(x)  # from x as it comes: the router runs in fp32
        out = self._routed_inference(x, weights, indices)
        if out is not None:
            return (out + self.shared_experts(x) if self.shared_experts is not None else out).view(shape)
        if torch.is_autocast_enabled(x.device.type):
            # Cast the N tokens once, not their N·K copies (autocast would at the first expert mm);
            # the gather, its gradient and the shared experts' input move half the bytes.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        routed, counts, state = self.dispatcher.dispatch(x, indices, self.cfg.n_routed_experts)
        # An all-to-all dispatcher returns with the exchange in flight: the shared experts run in
        # that window, and (being recorded between dispatch and wait) again in backward's.
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        routed = self.experts(self.dispatcher.wait(routed, state), counts)
        out = self.dispatcher.combine(routed, state, weights)
        if shared is not None:
            out = out + shared
        # Counted in training only (serving has no use for them), and not during activation-recompute
        # replays in backward, which would count every token twice. A compiled block's replay is its graph's,
        # which never runs this Python again: asking torch.compile for the graph task id would break the graph.
        counting = self.training and (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1)
        if counting:
            with torch.no_grad():  # this rank's routing decisions, whichever rank runs the experts
                num_tokens_per_expert = count_per_expert(indices.reshape(-1), self.cfg.n_routed_experts)
                self.tokens_per_expert += num_tokens_per_expert.to(self.tokens_per_expert.dtype)
        if self.training and self.aux_loss_coeff > 0:
            aux_loss = self.aux_loss_coeff * sequence_balance_loss(scores, indices, shape[0], self.cfg, self.row_counts)
            out = _AttachAuxLoss.apply(out, aux_loss, self.aux_grad_scale)
            if counting:
                self.aux_loss = self.aux_loss + aux_loss.detach()
        return out.view(shape)


    def _routed_inference(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
        """The routed experts' output by a path for inference without autograd (None: take the general
        one): on the GPU path (gpu/__init__.py), up to MAX_FUSED_MOE_TOKENS tokens → gpu/fused_moe.py's kernels
        (sync-free: a CUDA graph can capture them; not while torch.compile traces); batch 1 →
        GroupedExperts.forward_one_token; on CPU → GroupedExperts.forward_batched, while its
        padding stays within MAX_BATCHED_PADDING (oneDNN's dtypes) or MAX_BATCHED_PADDING_FP32 (a few hot
        experts, as at prefill sizes, would make the zero rows cost more than the per-expert loop's calls).
        Traced by torch.compile (serve/compiled.py), both take their traced forms, and a CPU batch is always the
        padded one: which is cheaper depends on the routing, which a compiled step cannot branch on."""
        if not self._plain_inference(x):
            return None
        if (gpu_path(x) and x.shape[0] <= MAX_FUSED_MOE_TOKENS and triton_ready(x)
                and not torch.compiler.is_compiling()):
            return fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, indices)
        if x.shape[0] == 1:
            return self.experts.forward_one_token(x, weights, indices)
        if x.device.type != "cpu":  # torch._grouped_mm, unpadded
            return None
        if torch.compiler.is_compiling():
            slots = ExpertSlots.traced(indices, self.cfg.n_routed_experts, uses_onednn(x.device, x.dtype))
            return self.experts.forward_batched(x, weights, slots)
        max_padding = MAX_BATCHED_PADDING if uses_onednn(x.device, x.dtype) else MAX_BATCHED_PADDING_FP32
        slots = ExpertSlots.within(indices, self.cfg.n_routed_experts, max_padding)
        return self.experts.forward_batched(x, weights, slots) if slots is not None else None

    def _plain_inference(self, x: torch.Tensor) -> bool:
        """No autograd, single device, the experts unquantized and in x's dtype (quant/ and parallel/ swap
        experts and dispatcher), and not hooked: the direct paths call GroupedExperts' methods, not the module,
        so its forward hooks would never see a token (quant/calibrate.py gathers each expert's inputs with one,
        probe/dump.py records modules' calls with them); a hooked layer dispatches as training does."""
        return (not self.training and not torch.is_grad_enabled()
                and type(self.experts) is GroupedExperts and type(self.dispatcher) is LocalDispatcher
                and self.experts.gate_up_proj.dtype == x.dtype and not torch.is_autocast_enabled(x.device.type)
                and not (self.experts._forward_pre_hooks or self.experts._forward_hooks))


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer output whose backward also feeds `grad_scale` into the aux loss (Megatron's
    MoEAuxLossAutoScaler): the balance loss trains the router through this layer's own backward, so it
    needs no path to the loss value — in a pipeline the layer may sit stages before the loss."""

    @staticmethod
    def forward(ctx, out, aux_loss, grad_scale):
        ctx.save_for_backward(aux_loss)
        ctx.grad_scale = grad_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (aux_loss,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux_loss, ctx.grad_scale), None


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch: int, cfg: ModelConfig,
                          row_counts=None):
    """DeepSeek-V3 eq. 17–20: per sequence, Σ_i f_i · P_i with f_i the (scaled) fraction of tokens
    routed to expert i and P_i its mean normalized affinity. scores (N, E), indices (N, K).

    row_counts: under context parallelism the rows' other chunks live on other ranks; row_counts(counts)
    sums the (B, E) counts over them and row_counts.parts is their number. f_i then counts the whole row
    (no gradient flows through it) and P_i takes only this rank's tokens, over the whole row's length: the
    ranks' values sum to the row's loss, and each rank's gradient is its own tokens' share."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    scores = scores.view(batch, -1, e)
    seq_len = scores.shape[1]
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    counts = torch.zeros(batch, e, device=scores.device)
    counts.scatter_add_(1, indices.view(batch, -1), torch.ones(batch, seq_len * k, device=scores.device))
    if row_counts is None:
        return (counts * e / (k * seq_len) * probs.mean(dim=1)).sum(dim=1).mean()
    row_len = seq_len * row_counts.parts
    return (row_counts(counts) * e / (k * row_len) * probs.sum(dim=1) / row_len).sum(dim=1).mean()
