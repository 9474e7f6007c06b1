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
    lm = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
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
