"""The pretraining objective: next-token cross-entropy + λ · mean MTP cross-entropy (DeepSeek-V3
eq. 25) + the optional sequence-wise balance loss collected from the MoE layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from seekforge.model.mtp import mtp_losses

IGNORE_INDEX = -100


def lm_loss(model, input_ids, labels, positions=None, segment_ids=None, mtp_loss_scale: float = 0.3):
    """input_ids, labels (B, T); labels = IGNORE_INDEX where no target. Returns (loss, metrics) where
    metrics holds detached `lm_loss`, `mtp_loss` (when the model has MTP) and `aux_loss`."""
    h, (cos, sin), mask = model.hidden(input_ids, positions, segment_ids)
    logits = model.lm_head(model.norm(h))
    lm = cross_entropy(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX)
    loss, metrics = lm, {"lm_loss": lm.detach()}
    if len(model.mtp) and mtp_loss_scale > 0:
        mtp = torch.stack(mtp_losses(model, h, input_ids, labels, cos, sin, mask, IGNORE_INDEX)).mean()
        loss = loss + mtp_loss_scale * mtp
        metrics["mtp_loss"] = mtp.detach()
    aux = [m.aux_loss for m in model.moe_layers() if m.aux_loss is not None]
    if aux:
        aux_total = torch.stack(aux).sum()
        if isinstance(loss, DTensor):
            # TP: the vocab-parallel loss is a replicated DTensor while the routers (not split by TP)
            # give every TP rank the same plain aux loss; mixing the two breaks autograd's products.
            aux_total = DTensor.from_local(aux_total, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
        loss = loss + aux_total
        metrics["aux_loss"] = aux_total.detach()
        for m in model.moe_layers():
            m.aux_loss = None
    return loss, metrics


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
