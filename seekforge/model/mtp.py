"""Multi-Token Prediction (DeepSeek-V3 §2.2).

MTP module k (1-based depth) predicts token t+k+1 at position t: it combines the previous depth's
hidden state h^{k-1}_t with the embedding of token t+k,
    h'_t = eh_proj([enorm(Emb(x_{t+k})); hnorm(h^{k-1}_t)]),
runs one transformer block over h', and scores it with the shared output head after its own norm.
Embedding and head are shared with the main model (the paper's design; HF checkpoints store copies).
"""

from __future__ import annotations

import torch
from torch import nn

from seekforge.config import ModelConfig
from seekforge.model.model import Block, RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = Block(cfg, layer_id)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # HF: shared_head.norm

    def forward(self, h_prev, next_embeds, cos, sin, mask=None):
        """h_prev, next_embeds (B, T, H) → this depth's hidden (B, T, H), before `norm`."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(h_prev)], dim=-1))
        return self.block(x, cos, sin, mask)


def shift_left(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x (B, T) shifted left by k along T, the last k entries set to `fill`."""
    out = torch.roll(x, -k, dims=1)
    out[:, x.shape[1] - k:] = fill
    return out


def mtp_losses(model, h, input_ids, labels, cos, sin, mask=None, ignore_index: int = -100):
    """Cross-entropy of each MTP depth. h (B, T, H) is the main model's last hidden state (before the
    final norm), labels (B, T) the next-token targets. Returns a list of scalar losses, one per depth.
    Positions whose target falls past the window are ignored; with packed documents, the segment mask
    keeps the block causal within a document, and targets from another document are masked by the
    caller's labels (−100 at document ends)."""
    from seekforge.train.loss import cross_entropy  # train/loss.py imports this module

    losses = []
    for k, module in enumerate(model.mtp, start=1):
        next_ids = shift_left(input_ids, k, 0)
        h = module(h, model.embed_tokens(next_ids), cos, sin, mask)
        logits = model.lm_head(module.norm(h))
        target = shift_left(labels, k, ignore_index)
        losses.append(cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index))
    return losses
