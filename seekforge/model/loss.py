"""The training objective, defined once for every loop that trains: the single-device trainer, the
pipeline's last stage (parallel/pp.py) and the GRPO trainer call these functions.

    loss = CE(next token) + λ · mean_k CE_k(MTP depth k)          (DeepSeek-V3 eq. 25)

plus the sequence-wise balance loss α·Σ f_i P_i of every MoE layer (eq. 17–20). That term does not go
through the value computed here: each MoE layer attaches its own to its output's gradient
(`attach_aux_loss`), so it reaches the router wherever the layer runs — in this process or in an
earlier pipeline stage — and the loss value stays the same function on every layout. Its detached
value is summed by the layers for logging (`MoE.aux_loss`).

Packed rows (per-document `positions` and `segment_ids`) keep every target inside its document: the
data layer already masks the next-token label at a document's end, and `mtp_targets` masks the MTP
targets whose token t+k+1 lies in another document than position t.

On the GPU path (model/gpu) each head's cross-entropy is one fused linear + cross-entropy
(`head_loss`, model/gpu/cross_entropy.py): the (B·T, V) logits are never materialized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from seekforge.model.gpu import gpu_path, triton_ready

IGNORE_INDEX = -100  # the label that cross_entropy skips


def lm_loss(model, input_ids, labels, positions=None, segment_ids=None, mtp_loss_scale: float = 0.3):
    """Forward `model` (a Transformer) and compute the objective. input_ids, labels (B, T); labels =
    IGNORE_INDEX where there is no target. Returns (loss, metrics), metrics holding the detached
    `lm_loss` and, with MTP, `mtp_loss`."""
    h, rope, mask = model.hidden(input_ids, positions, segment_ids)
    return objective(model, h, input_ids, labels, rope, mask, segment_ids, mtp_loss_scale)


def objective(head, h, input_ids, labels, rope, mask=None, segment_ids=None, mtp_loss_scale: float = 0.3,
              shifted=None, reduce=None):
    """The objective on the main model's last hidden state h (B, T, H), before the final norm.
    head: anything holding `norm`, `lm_head`, `mtp` and `embed_tokens` (a Transformer, or the last
    pipeline stage); rope: (cos, sin) of the positions; mask: the attention mask the blocks used.
    shifted, reduce: see mtp_losses; reduce(loss, labels) also rescales the next-token loss."""
    lm = head_loss(head.lm_head, head.norm(h), labels)
    if reduce is not None:
        lm = reduce(lm, labels)
    loss, metrics = lm, {"lm_loss": lm.detach()}
    if len(head.mtp) and mtp_loss_scale > 0:
        mtp = torch.stack(mtp_losses(head, h, input_ids, labels, rope, mask, segment_ids, shifted, reduce)).mean()
        loss = loss + mtp_loss_scale * mtp
        metrics["mtp_loss"] = mtp.detach()
    return loss, metrics


def mtp_losses(head, h, input_ids, labels, rope, mask=None, segment_ids=None, shifted=None,
               reduce=None) -> list[torch.Tensor]:
    """Cross-entropy of each MTP depth k = 1, 2, ...: module k combines the previous depth's hidden
    state at position t with the embedding of token t+k and predicts token t+k+1 (model.MTPModule).

    h (B, T, H) is the main model's hidden state BEFORE its final norm (the module's own `hnorm`
    normalizes it); the serving engine's MTP drafts take the same (serve/spec_decode.py). vLLM's and
    SGLang's DeepSeek drafters feed the target's post-norm output instead; training on that made the
    pipeline + FSDP/EP and pipeline + TP runs drift from the single-device run (one MTP expert by
    1.4e-3 after 3 steps, seed-dependent), so it stays pre-norm until that is understood. Depth k > 1
    takes depth k-1's output before that module's `norm`.

    shifted: per depth, the (token t+k ids, targets) pairs computed on the full rows (`mtp_shifted`)
    when these rows are slices of them (context parallelism: token t+k may sit on another rank);
    reduce(loss, targets): rescales each depth's mean, e.g. to a share of the mean over all ranks."""
    cos, sin = rope
    losses = []
    for k, module in enumerate(head.mtp, start=1):
        next_ids, targets = shifted[k - 1] if shifted is not None else mtp_shifted(input_ids, labels, k, segment_ids)
        h = module(h, head.embed_tokens(next_ids), cos, sin, mask)
        loss = head_loss(head.lm_head, module.norm(h), targets)
        losses.append(loss if reduce is None else reduce(loss, targets))
    return losses


def mtp_shifted(input_ids, labels, k: int, segment_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth k's inputs on full rows (B, T): the ids of token t+k (0 past the window) and the targets."""
    return shift_left(input_ids, k, 0), mtp_targets(labels, k, segment_ids)


def head_loss(lm_head: nn.Module, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """cross_entropy(lm_head(normed)) for normed (B, T, H) and labels (B, T). On the GPU path, a plain
    single-device head runs as model/gpu's fused linear + cross-entropy, which reads lm_head.weight
    directly: not a tensor-parallel head (a DTensor weight), nor one with hooks on its forward (FSDP
    gathers a sharded weight in them, probe/ records the calls), which keep the reference path."""
    if _fused_head(lm_head, normed):
        from seekforge.model.gpu.cross_entropy import fused_linear_cross_entropy  # imports triton: on use

        return fused_linear_cross_entropy(normed.flatten(0, 1), lm_head.weight, labels.flatten(), IGNORE_INDEX)
    return cross_entropy(lm_head(normed).flatten(0, 1), labels.flatten())


def _fused_head(lm_head: nn.Module, normed: torch.Tensor) -> bool:
    return (gpu_path(normed) and triton_ready(normed) and type(normed) is torch.Tensor
            and isinstance(lm_head, nn.Linear) and lm_head.bias is None and not isinstance(lm_head.weight, DTensor)
            and not lm_head._forward_hooks and not lm_head._forward_pre_hooks)


def mtp_targets(labels: torch.Tensor, k: int, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """labels (B, T) next-token targets → depth-k targets (B, T): token t+k+1 at position t, ignored
    past the window and, with packed documents, where position t+k lies in another document than t
    (then token t+k+1 does too, or labels[t+k] is already ignored at that document's end)."""
    target = shift_left(labels, k, IGNORE_INDEX)
    if segment_ids is not None:
        crosses = shift_left(segment_ids, k, -1) != segment_ids
        target = target.masked_fill(crosses, IGNORE_INDEX)
    return target


def shift_left(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x (B, T) shifted left by k along T, the last k entries set to `fill`."""
    out = torch.roll(x, -k, dims=1)
    out[:, x.shape[1] - k:] = fill
    return out


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """F.cross_entropy(logits.float(), labels, ignore_index) (mean over kept rows), for logits (N, V) in
    any float dtype, without an fp32 copy of the whole (N, V) logits forward or backward: rows go
    through fp32 in cache-sized chunks (`_ChunkedCrossEntropy`)."""
    if type(logits) is not torch.Tensor:  # a DTensor (tensor-parallel head): DTensor's own loss ops
        return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
    return _ChunkedCrossEntropy.apply(logits, labels, ignore_index)


class _ChunkedCrossEntropy(torch.autograd.Function):
    # ~1 MiB of fp32 logits per chunk (64 rows of a 4096 vocab): the cast, exp and sums stay in L2.
    CHUNK_ELEMENTS = 2**18

    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        n, vocab = logits.shape
        keep = labels != ignore_index  # (N,)
        targets = labels.masked_fill(~keep, 0)
        rows = max(16, _ChunkedCrossEntropy.CHUNK_ELEMENTS // vocab)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # log Σ exp, per row
        for start in range(0, n, rows):
            lse[start:start + rows] = torch.logsumexp(logits[start:start + rows].float(), dim=-1)
        target_logit = logits.gather(1, targets[:, None]).squeeze(1).float()
        count = keep.sum()
        ctx.save_for_backward(logits, targets, keep, lse, count)
        ctx.rows = rows
        # mean over kept rows; 0/0 = nan when every row is ignored, as F.cross_entropy
        return ((lse - target_logit) * keep).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, targets, keep, lse, count = ctx.saved_tensors
        row_scale = keep * (grad / count)  # (N,) d loss / d (per-row loss)
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            probs = (logits[start:end].float() - lse[start:end, None]).exp_()  # softmax
            probs.scatter_add_(1, targets[start:end, None], probs.new_full((probs.shape[0], 1), -1.0))
            grad_logits[start:end] = probs.mul_(row_scale[start:end, None])  # (softmax − onehot) · scale
        return grad_logits, None, None
