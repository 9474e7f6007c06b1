"""GRPO as pure functions: advantages, per-token log-probs at the sampling temperature, the policy losses
(clipped surrogate, two-sided clipping, CISPO, SAPO; token- or sequence-level importance ratios), the k3 KL
with TRL's optional bias correction, the loss aggregations, and the high-entropy token mask — under the
names and with the values TRL 1.16's GRPOTrainer gives them (tests/rl/test_trl_end_to_end.py runs both).

Shape legend: N sequences (prompts × G completions, group-major: the G completions of a prompt are
adjacent), G group size, V vocab, n the sequences of one piece of work (a rank's share), and "per token"
tensors: the flat completion tokens of packed rows (or any shape a caller picks: the functions are
elementwise over tokens, except `sequence_mean`, which takes each token's sequence index).

The aggregation is written as per-token weights: loss = Σ_tokens weight · per_token_loss, with the weights
computed once from the *whole* batch (all micro-batches, all data-parallel ranks; `sequence_weights`). A sum
splits over rows and ranks exactly, so the gradient of the whole batch is the sum of the pieces' gradients
whatever the split. The one place the batch's division into micro-batches matters is where TRL makes it
matter: `bnpo` normalizes each micro-batch by its own token count, and `top_entropy_quantile` takes the
quantile over each micro-batch's tokens (`micro_batch_size` consecutive sequences; 0: one micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossSettings:
    """The loss's parameters (GRPOConfig's fields of the same names; TRL's in brackets where they differ)."""

    loss_type: str = "dapo"
    clip_low: float = 0.2  # [epsilon]
    clip_high: float = 0.28  # [epsilon_high]; cispo: the cap of the ratio itself (ε_max)
    beta: float = 0.0  # KL-to-reference coefficient; 0 skips the reference model entirely
    temperature: float = 1.0  # the sampling temperature: log-probs are of logits / temperature
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05


def scale_rewards_mode(scale_rewards: str | bool) -> str:
    """TRL's scale_rewards values: "group" | "batch" | "none", and the bools it also takes (True: "group",
    False: "none")."""
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}; choose one of {SCALE_REWARDS} (or true / false)")
    return scale_rewards


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str | bool = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """rewards (N,) group-major → advantages (N,): r − mean(group), divided by std + eps where
      "group"  std over the group (GRPO)
      "batch"  std over the whole batch (PPO Lite, arXiv:2508.08221: group-mean baseline, batch-wide scale)
      "none"   no division (Dr. GRPO, arXiv:2503.20783 §3.1: the group std overweights groups whose
               rewards barely differ)
    std is Bessel-corrected and eps = 1e-4, as TRL computes them. A group whose rewards are all equal gets
    zero advantages: it carries no learning signal."""
    mode = scale_rewards_mode(scale_rewards)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)  # (N/G, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if mode == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif mode == "batch" and rewards.numel() > 1:
        centered = centered / (grouped.std() + eps)
    return centered.view(-1)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 1024, temperature: float = 1.0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (..., V) of any float dtype, targets (...) → (log p(target), entropy), both (...) fp32, of the
    distribution softmax(logits / temperature): the one the rollout sampled from at that temperature, so the
    ratio's π_old is the sampler and the policy optimized is the one that samples (as TRL and verl do).

    Rows go through fp32 in chunks, so a bf16 (T, V) logits tensor never gets a whole fp32 copy (the
    log-softmax of a long rollout is the largest activation of a GRPO step)."""
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    logps, entropies = [], []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[start:start + chunk_rows].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        log_probs = chunk.log_softmax(dim=-1)  # (rows, V)
        logps.append(log_probs.gather(1, flat_targets[start:start + chunk_rows, None]).squeeze(1))
        with torch.no_grad():  # entropy is a metric and a mask, never differentiated
            entropies.append(-(log_probs.exp() * log_probs).sum(dim=-1))
    logp = torch.cat(logps) if logps else flat_logits.new_zeros(0, dtype=torch.float32)
    entropy = torch.cat(entropies) if entropies else logp.detach()
    return logp.view(targets.shape), entropy.view(targets.shape)


def sequence_mean(values: torch.Tensor, sequence_of_token: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """values (C,) per token → (C,): each token gets the mean of its sequence's values (differentiable).
    sequence_of_token (C,) indexes [0, num_sequences)."""
    sums = values.new_zeros(num_sequences).index_add(0, sequence_of_token, values)
    counts = values.new_zeros(num_sequences).index_add(0, sequence_of_token, torch.ones_like(values))
    return (sums / counts.clamp(min=1))[sequence_of_token]


def surrogate(ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, settings: LossSettings,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy term per token, as a loss, and where its clip is active (the logged clip fraction).

      clipped (grpo, bnpo, dapo, dr_grpo)  −min(ρ·A, clip(ρ, 1 − clip_low, 1 + clip_high)·A): PPO's clip; a
          larger clip_high is DAPO's clip-higher (arXiv:2503.14476 §3.1). With `delta`, ρ in the first term
          is capped at δ too (INTELLECT-2's two-sided clipping, arXiv:2505.07291): a negative-advantage
          token whose ratio has run away no longer gets an unbounded gradient.
      cispo  −sg(min(ρ, clip_high))·A·log π (MiniMax-M1, arXiv:2506.13585): the importance weight is capped
          and detached, so every token keeps a gradient; clip_high caps ρ itself (TRL's epsilon_high, ε_max).
      sapo   −σ(τ(ρ − 1))·4/τ·A with τ = sapo_temperature_pos for A > 0, else _neg (arXiv:2511.20347): a
          smooth gate in place of the hard clip.
    ratio: ρ = π/π_old per token (at importance_sampling_level="sequence", its sequence's geometric mean).
    → (loss (C,), clipped (C,) bool)."""
    if settings.loss_type == "cispo":
        capped = ratio.clamp(max=settings.clip_high).detach()
        return -capped * advantages * logp, (ratio > settings.clip_high) & (advantages > 0)
    if settings.loss_type == "sapo":
        tau = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages, torch.zeros_like(ratio, dtype=torch.bool)
    clipped_ratio = ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    if settings.delta is not None:
        ratio = ratio.clamp(max=settings.delta)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    is_clipped = (((ratio < 1 - settings.clip_low) & (advantages < 0))
                  | ((ratio > 1 + settings.clip_high) & (advantages > 0)))
    return loss, is_clipped


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate k3 = exp(ref − logp) − (ref − logp) − 1 (Schulman, "Approximating
    KL divergence"): unbiased on samples from π, and never negative, unlike log(π/π_ref)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                settings: LossSettings, ref_logp: torch.Tensor | None = None,
                sequence_of_token: torch.Tensor | None = None, num_sequences: int = 0,
                policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This piece's share of the GRPO loss: Σ weights · (policy_mask · surrogate + β · KL). All per-token
    tensors share one shape; weights are 0 off the scored tokens. sequence_of_token / num_sequences: each
    token's sequence (needed at importance_sampling_level="sequence", GSPO arXiv:2507.18071: one ratio per
    sequence, exp of the mean log-ratio over its tokens). policy_mask: top_entropy_quantile's tokens (the KL
    term is not masked, as in TRL).

    The KL is k3; with use_bias_correction_kl it is multiplied by the (differentiable) ratio ρ, which makes
    its gradient the unbiased reverse-KL gradient ρ·log(π/π_ref)·∇log π (DeepSeek-V3.2, arXiv:2512.02556)
    instead of k3's (1 − π_ref/π)·∇log π — TRL 1.16's default; it changes the gradient even where ρ = 1.
    → (loss, detached per-token {"clipped": 0/1, "kl": the KL term's estimate (β ≠ 0)}: the caller
    averages them over tokens; TRL's clip fraction at importance_sampling_level="sequence" is a mean over
    sequences instead)."""
    log_ratio = logp - old_logp
    if settings.importance_sampling_level == "sequence":
        log_ratio = sequence_mean(log_ratio, sequence_of_token, num_sequences)
    ratio = torch.exp(log_ratio)
    loss, is_clipped = surrogate(ratio, logp, advantages, settings)
    if policy_mask is not None:
        loss = loss * policy_mask
    stats = {"clipped": is_clipped.float()}
    if settings.beta != 0.0:
        kl = k3_kl(logp, ref_logp)
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + settings.beta * kl
        stats["kl"] = kl.detach()
    return (loss * weights).sum(), stats


def sequence_weights(loss_type: str, lengths: torch.Tensor, max_completion_length: int,
                     scored: torch.Tensor | None = None, micro_batch_size: int = 0) -> torch.Tensor:
    """The whole batch's per-token loss weight, one per sequence (all of a sequence's tokens get the same):
    loss = Σ_i weight_i · Σ_{tokens of i} per_token_loss. lengths (N,) completion lengths, group-major;
    scored (N,) bool: the sequences in the loss (False: masked out, mask_truncated_completions; they still
    count as sequences where TRL counts them). As TRL 1.16 aggregates:

      grpo, sapo  mean over each sequence's tokens, then over sequences: 1 / (len_i · N)
      bnpo        mean over each micro-batch's tokens, then over micro-batches: 1 / (tokens(mb) · N/mb)
      dapo, cispo mean over all the batch's tokens: 1 / Σ len
      dr_grpo     a constant, so no length bias (Dr. GRPO §3.1): 1 / (N · max_completion_length)

    micro_batch_size: bnpo's micro-batches, consecutive sequences (TRL's per_device_train_batch_size; 0:
    the whole batch, where bnpo equals dapo). → (N,) fp32, 0 where not scored."""
    N = lengths.numel()
    scored = torch.ones(N, dtype=torch.bool) if scored is None else scored
    tokens = lengths * scored
    if loss_type in ("grpo", "sapo"):
        weights = 1.0 / (lengths.clamp(min=1).double() * N)
    elif loss_type == "bnpo":
        size = micro_batch_size or N
        if N % size:
            raise ValueError(f"{N} sequences do not split into micro-batches of {size}")
        per_micro_batch = tokens.view(-1, size).sum(dim=1).clamp(min=1).double() * (N // size)
        weights = (1.0 / per_micro_batch).repeat_interleave(size)
    elif loss_type in ("dapo", "cispo"):
        weights = torch.full((N,), 1.0 / max(int(tokens.sum()), 1), dtype=torch.float64)
    elif loss_type == "dr_grpo":
        weights = torch.full((N,), 1.0 / (N * max_completion_length), dtype=torch.float64)
    else:
        raise ValueError(f"loss_type={loss_type!r}; choose one of {LOSS_TYPES}")
    return (weights * scored).float()


def token_share(lengths: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """Per sequence, the weight of each of its tokens in a token mean over the batch's scored tokens (the
    logged clip fraction, entropy and KL are token means, as TRL logs them). → (N,) fp32."""
    scored = torch.ones(lengths.numel(), dtype=torch.bool) if scored is None else scored
    return (scored / max(int((lengths * scored).sum()), 1)).float()


def high_entropy_masks(entropies: list[torch.Tensor], scored: list[bool], micro_batch_size: int, quantile: float,
                       ) -> list[torch.Tensor]:
    """top_entropy_quantile (arXiv:2506.01939, "Beyond the 80/20 rule"): per sequence, which tokens stay in
    the policy term — those whose entropy is at least the (1 − quantile) quantile of their micro-batch's
    scored tokens (linear interpolation, as TRL's torch.quantile). entropies: the whole batch's, per
    sequence (len_i,); scored: per sequence. → per sequence (len_i,) bool (all False where not scored)."""
    N = len(entropies)
    size = micro_batch_size or N
    masks = []
    for start in range(0, N, size):
        members = range(start, min(start + size, N))
        values = [entropies[i].float() for i in members if scored[i]]
        threshold = torch.quantile(torch.cat(values), 1 - quantile) if values else None
        for i in members:
            if threshold is None or not scored[i]:
                masks.append(torch.zeros_like(entropies[i], dtype=torch.bool))
            else:
                masks.append(entropies[i] >= threshold)
    return masks
