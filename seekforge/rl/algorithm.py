"""GRPO as pure functions: advantages, per-token log-probs, the clipped surrogate, the k3 KL, and the
loss aggregations under the names TRL gives them.

Shape legend: N sequences (prompts × G completions, group-major: the G completions of a prompt are
adjacent), G group size, V vocab, and "per token" tensors of any shape (padded (N, T) rows with a
mask, or the flat completion tokens of packed rows) — every function here is elementwise over tokens,
so it does not care which.

The aggregation is written as per-token weights: loss = Σ_tokens weight · per_token_loss, with the
weights computed from *global* batch totals (all micro-batches, all data-parallel ranks). A sum
splits over micro-batches and ranks exactly, so the gradient of the whole batch is the sum of the
pieces' gradients whatever the split — the point of `bnpo`/`dapo` normalizing by the global token
count instead of each micro-batch's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """rewards (N,) group-major → advantages (N,): r − mean(group), divided by (std(group) + eps)
    unless `scale_by_std` is False (Dr. GRPO, arXiv:2503.20783 §3.1: the std division overweights
    groups whose rewards barely differ). std is Bessel-corrected and eps = 1e-4, as TRL computes it.
    A group whose rewards are all equal gets zero advantages: it carries no learning signal."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)  # (N/G, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.view(-1)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 1024,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (..., V) of any float dtype, targets (...) → (log p(target), entropy), both (...) fp32.

    Rows go through fp32 in chunks, so a bf16 (T, V) logits tensor never gets a whole fp32 copy (the
    log-softmax of a long rollout is the largest activation of a GRPO step)."""
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    logps, entropies = [], []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        log_probs = flat_logits[start:start + chunk_rows].float().log_softmax(dim=-1)  # (rows, V)
        logps.append(log_probs.gather(1, flat_targets[start:start + chunk_rows, None]).squeeze(1))
        with torch.no_grad():  # entropy is a metric, never differentiated
            entropies.append(-(log_probs.exp() * log_probs).sum(dim=-1))
    logp = torch.cat(logps) if logps else flat_logits.new_zeros(0, dtype=torch.float32)
    entropy = torch.cat(entropies) if entropies else logp.detach()
    return logp.view(targets.shape), entropy.view(targets.shape)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective per token, as a loss: −min(ρ·A, clip(ρ, 1 − clip_low, 1 + clip_high)·A)
    with ρ = exp(logp − old_logp). A separate, larger clip_high is DAPO's clip-higher (arXiv:2503.14476
    §3.1): low-probability tokens may grow further before the clip stops their gradient.
    advantages broadcast against logp (one per sequence, expanded over its tokens).
    → (per-token loss, per-token bool: the clip is active, i.e. the gradient is cut there)."""
    ratio = torch.exp(logp - old_logp)
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    is_clipped = ((ratio < 1 - clip_low) & (advantages < 0)) | ((ratio > 1 + clip_high) & (advantages > 0))
    return loss, is_clipped


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate k3 = exp(ref − logp) − (ref − logp) − 1 (Schulman, "Approximating
    KL divergence"): unbiased on samples from π, and never negative, unlike log(π/π_ref)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


@dataclass
class BatchTotals:
    """What the aggregation needs from the whole rollout batch (summed over data-parallel ranks)."""

    num_sequences: int
    num_completion_tokens: int
    max_completion_length: int  # the configured max_tokens: Dr. GRPO's constant


def token_weights(loss_type: str, completion_lengths: torch.Tensor, totals: BatchTotals) -> torch.Tensor:
    """Per-token weights w with loss = Σ w · per_token_loss over the batch's completion tokens.
    completion_lengths: per token, the length of the completion it belongs to (same shape as the
    per-token tensors; 0 or anything on padding, which the caller masks).

      grpo     mean over each sequence's tokens, then over sequences: 1 / (len_i · N)
      bnpo     mean over all tokens of the batch: 1 / Σ len
      dapo     the same token mean (TRL normalizes dapo by the generation batch's token count, which
               is bnpo's global count; its bnpo uses the micro-batch's own count instead)
      dr_grpo  a constant, so no length bias (Dr. GRPO §3.1): 1 / (N · max_completion_length)
    """
    if loss_type == "grpo":
        return 1.0 / (completion_lengths.clamp(min=1).float() * totals.num_sequences)
    if loss_type in ("bnpo", "dapo"):
        return torch.full_like(completion_lengths, 1.0 / max(totals.num_completion_tokens, 1), dtype=torch.float32)
    if loss_type == "dr_grpo":
        return torch.full_like(completion_lengths, 1.0 / (totals.num_sequences * totals.max_completion_length),
                               dtype=torch.float32)
    raise ValueError(f"loss_type={loss_type!r}; choose one of {LOSS_TYPES}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                clip_low: float, clip_high: float, beta: float = 0.0, ref_logp: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This piece's share of the GRPO loss: Σ weights · (clipped surrogate + β · k3 KL). All per-token
    tensors share one shape; weights are 0 off the completion tokens.
    → (loss, detached weighted sums {"kl", "clipped"} whose totals over pieces are the batch means)."""
    loss, is_clipped = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high)
    stats = {"clipped": (is_clipped.float() * weights).sum().detach()}
    if beta != 0.0:
        kl = k3_kl(logp, ref_logp)
        loss = loss + beta * kl
        stats["kl"] = (kl * weights).sum().detach()
    return (loss * weights).sum(), stats
