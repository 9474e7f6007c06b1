"""Fused linear + cross-entropy for training on the GPU path: the loss of `hidden @ weightᵀ` against `labels`
without the (N, V) logits ever existing in full (Liger-Kernel's FusedLinearCrossEntropy, Hsu et al. 2024).

Shape legend: N rows (tokens), H hidden, V vocabulary, R rows of one chunk.

The rows go through in a few large chunks (CHUNK_LOGITS_BYTES of logits each, from the shapes alone). Per
chunk: logits = h_c @ Wᵀ (R, V) in the compute dtype, then a Triton kernel computes each row's log-sum-exp
online over the vocabulary (one row per program at a large vocabulary), its loss, and writes
(softmax − onehot) / count over the logits in place; that gradient g then gives grad_h_c = g @ W and
grad_W += gᵀ @ h_c. The gradients are computed in forward and only scaled by grad_output in backward, so
nothing of size (N, V) is saved either. `count`, the
kept rows, stays on the device (the kernel reads it): the loss never syncs with the host.

model/loss.py's `cross_entropy(lm_head(norm(h)))` is the reference (and stays the path on CPU, and for
tensor-parallel or FSDP-sharded heads); `fused_linear_cross_entropy` equals it within rounding.
"""

from __future__ import annotations

import math

import torch

from seekforge.model.gpu import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # the GPU path's kernels only: model/loss.py asks triton_ready before it calls here
    triton = None

# Logits of one chunk at most this many bytes (in the compute dtype): a few chunks even at a 128k vocabulary,
# so the matmuls stay large, while the transient buffer stays a small share of a GPU's memory.
CHUNK_LOGITS_BYTES = 512 << 20
TILE = 32768  # logits a program holds at a time (Liger's MAX_FUSED_SIZE): one row of a large vocabulary's
MAX_TILE_ROWS = 64  # or up to this many rows of a small one (fewer programs; in the interpreter, far fewer)


if triton is not None:

    @triton.jit
    def _loss_and_grad_rows(logits_ptr, labels_ptr, count_ptr, loss_ptr, n_rows, stride, vocab, ignore_index,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
        """ROWS rows of the chunk: loss_ptr[row] = lse − logit[label] (0 where ignored) and, in place of the
        row's logits, (softmax − onehot(label)) / count (zeros where ignored). Two passes over the rows in
        (ROWS, BLOCK) tiles: the online max and sum, then the gradient. Every load becomes fp32 before any
        arithmetic, on a GPU as in Triton's interpreter (UPCAST is for the interpreter's bf16, which this
        kernel never computes in)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        in_chunk = rows < n_rows
        rows = tl.minimum(rows, n_rows - 1).to(tl.int64)  # rows past the chunk read its last one, store nothing
        label = tl.load(labels_ptr + rows)
        keep = (label != ignore_index) & in_chunk
        count = tl.load(count_ptr).to(tl.float32)
        scale = tl.where(keep, 1.0 / tl.maximum(count, 1.0), 0.0)  # a kept row makes count ≥ 1
        target = tl.where(keep, label, 0)
        row_ptr = logits_ptr + rows * stride  # (ROWS,)
        running_max = tl.full((ROWS,), -float("inf"), tl.float32)
        running_sum = tl.zeros((ROWS,), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr[:, None] + cols[None, :], mask=cols[None, :] < vocab, other=-float("inf"))
            x = x.to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=1))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        target_logit = tl.load(row_ptr + target).to(tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols[None, :] < vocab
            x = tl.load(row_ptr[:, None] + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse[:, None]) - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
            tl.store(row_ptr[:, None] + cols[None, :], (grad * scale[:, None]).to(logits_ptr.dtype.element_ty),
                     mask=inside & in_chunk[:, None])
        tl.store(loss_ptr + rows, tl.where(keep, lse - target_logit, 0.0), mask=in_chunk)


def loss_and_grad_rows_(logits: torch.Tensor, labels: torch.Tensor, count: torch.Tensor, loss: torch.Tensor,
                        ignore_index: int, block: int | None = None) -> None:
    """The kernel over a chunk: logits (R, V) (row-contiguous) are overwritten by their gradient
    (softmax − onehot) / count, loss (R,) fp32 gets each row's loss; labels (R,), count a 0-d device tensor.
    block: vocabulary columns per tile (tests force one that does not divide V). The grid depends on the
    shapes only."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return
    block = block or min(TILE, triton.next_power_of_2(vocab))
    rows = min(MAX_TILE_ROWS, max(1, TILE // block), triton.next_power_of_2(n_rows))
    _loss_and_grad_rows[(triton.cdiv(n_rows, rows),)](
        logits, labels, count, loss, n_rows, logits.stride(0), vocab, ignore_index, ROWS=rows, BLOCK=block,
        UPCAST=interpreting(), num_warps=32 if rows * block >= TILE else 8)


def loss_and_grad_rows_reference(logits, labels, count, ignore_index):
    """loss_and_grad_rows_ in torch (a new gradient, not in place): (R, V) gradient in logits' dtype, (R,) loss."""
    keep = labels != ignore_index
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    target = labels.masked_fill(~keep, 0)
    probs = (x - lse[:, None]).exp()
    probs.scatter_add_(1, target[:, None], probs.new_full((len(target), 1), -1.0))
    scale = torch.where(keep, 1.0 / count.float(), 0.0)
    loss = torch.where(keep, lse - x.gather(1, target[:, None]).squeeze(1), 0.0)
    return (probs * scale[:, None]).to(logits.dtype), loss


def chunk_rows(n: int, vocab: int, element_size: int) -> int:
    """Rows per chunk from the shapes: as many as CHUNK_LOGITS_BYTES of logits hold, then evened out over the
    chunks that takes (equal matmul shapes, no small last chunk)."""
    most = max(1, CHUNK_LOGITS_BYTES // (vocab * element_size))
    chunks = max(1, math.ceil(n / most))
    return max(1, math.ceil(n / chunks))


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, rows: int | None = None) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=ignore_index): the mean loss over
    the kept rows (0/0 = nan when every row is ignored, as F.cross_entropy), fp32, for hidden (N, H), weight
    (V, H), labels (N,) in [0, V) or ignore_index. Under autocast the matmuls run in its dtype (hidden and the
    weight cast once), as F.linear's would. rows: rows per chunk (default: chunk_rows of the shapes)."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    if rows is None:
        rows = chunk_rows(hidden.shape[0], weight.shape[0], torch.finfo(dtype).bits // 8)
    # forward computes the gradients: not under no_grad (an evaluation), where needs_input_grad still says True
    grads = torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, dtype, rows, grads)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, dtype, rows, grads):
        ctx.hidden_dtype = hidden.dtype
        with torch.autocast(hidden.device.type, enabled=False):  # out= is refused under autocast
            h, w = hidden.to(dtype), weight.to(dtype)  # cast once (N, H), (V, H); no copy when already dtype
            need_h, need_w = (grads and needs for needs in ctx.needs_input_grad[:2])
            loss, grad_h, grad_w = _loss_and_gradients(h, w, labels, ignore_index, rows, need_h, need_w)
        if grad_w is not None:  # kept until backward in the weight's dtype (a bf16 weight's: half an fp32 sum)
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        hidden_dtype = ctx.hidden_dtype
        grad_hidden = (grad_h * grad).to(hidden_dtype) if grad_h is not None else None
        grad_weight = grad_w * grad if grad_w is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def _loss_and_gradients(h, w, labels, ignore_index, rows, need_h, need_w):
    """h (N, H), w (V, H) in one dtype → the mean loss (fp32), d loss/d h (N, H) in h's dtype, d loss/d w
    (V, H) in fp32 (summed over chunks) or w's dtype (one chunk); None where not needed."""
    n, vocab = h.shape[0], w.shape[0]
    labels = labels.contiguous()
    count = (labels != ignore_index).sum()  # kept rows, on the device: the kernel divides by it
    loss_rows = torch.empty(n, dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_h else None
    chunks = range(0, n, rows)
    grad_w = None
    if need_w and len(chunks) > 1:
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    logits = h.new_empty(min(rows, n), vocab)  # one buffer for every chunk's logits, then their gradient
    for start in chunks:
        end = min(start + rows, n)
        h_c, g = h[start:end], logits[:end - start]
        torch.mm(h_c, w.t(), out=g)  # (R, V)
        loss_and_grad_rows_(g, labels[start:end], count, loss_rows[start:end], ignore_index)
        if need_h:
            torch.mm(g, w, out=grad_h[start:end])  # (R, H)
        if need_w:
            if grad_w is None:
                grad_w = torch.mm(g.t(), h_c)  # (V, H): the only chunk
            elif grad_w.dtype == h.dtype:
                grad_w.addmm_(g.t(), h_c)
            else:
                grad_w += torch.mm(g.t(), h_c)  # a bf16 partial summed in fp32
    return loss_rows.sum() / count, grad_h, grad_w
