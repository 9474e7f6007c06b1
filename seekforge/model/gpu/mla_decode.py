"""Absorbed-MLA decode attention over the paged latent cache (serve/kv_cache.py's pools), for the GPU path.

Each decode row is one query token (a plain decode, or one row of a speculative verify) with its own block
table and context length. In the absorbed form (model.MLA.attend_absorbed) the heads' queries are already
folded into latent space, q_latent (B, nh, r) and q_rope (B, nh, dr), and attend to the cached latents
directly: keys [c_kv | k_pe], values c_kv, shared by every head (a single-head attention whose query rows
are the nh heads).

`mla_decode` is the entry point; `mla_decode_reference` is its torch reference (the gathered context, fp32
softmax), sync-free too. A row with context length 0 (a padding row of a CUDA graph's batch) outputs zeros.
"""

from __future__ import annotations

import torch


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q_latent (B, nh, r), q_rope (B, nh, dr); pools c_kv (P, L, r), k_pe (P, L, dr); block_tables (B, W)
    int (padded with any valid block), context_lens (B,) int → (B, nh, r) in q_latent's dtype: for row b,
    softmax(scale · (q_latent·c_kvᵀ + q_rope·k_peᵀ)) · c_kv over its first context_lens[b] cached tokens."""
    return mla_decode_reference(q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, scale)


def mla_decode_reference(q_latent, q_rope, c_kv, k_pe, block_tables, context_lens, scale) -> torch.Tensor:
    b, w = block_tables.shape
    size = c_kv.shape[1]
    keys = c_kv[block_tables].view(b, w * size, -1).float()  # (B, S, r)
    rope_keys = k_pe[block_tables].view(b, w * size, -1).float()  # (B, S, dr)
    scores = (torch.bmm(q_latent.float(), keys.transpose(1, 2))
              + torch.bmm(q_rope.float(), rope_keys.transpose(1, 2))) * scale  # (B, nh, S)
    visible = torch.arange(w * size, device=scores.device) < context_lens[:, None]  # (B, S)
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # a row with no context: all -inf → zeros
    return torch.bmm(probs, keys).to(q_latent.dtype)
