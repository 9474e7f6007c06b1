"""GRPO's pure functions: each loss type equals TRL's GRPOTrainer loss (its own `_compute_loss`, fed our
per-token log-probs), advantages equal TRL's, and the token weights split over micro-batches exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from seekforge.rl.algorithm import (
    BatchTotals,
    group_advantages,
    k3_kl,
    policy_loss,
    token_log_probs,
    token_weights,
)

B, T, G, MAX_LEN = 8, 6, 4, 6


def rollout_tensors(seed: int = 0):
    """Per-token log-probs (B, T) for the current, old and reference policy, a completion mask with
    different lengths, and per-sequence advantages."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64).float() * 3
    old = logp + 0.3 * torch.randn(B, T, generator=gen)  # far enough that both clips trigger
    ref = logp + 0.2 * torch.randn(B, T, generator=gen)
    lengths = torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])
    mask = (torch.arange(T) < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (B,), generator=gen).float()
    advantages = group_advantages(rewards, G)
    return logp, old, ref, mask, advantages


def trl_loss(loss_type: str, beta: float, logp, old, ref, mask, advantages, eps_low=0.2, eps_high=0.28):
    """TRL's GRPOTrainer._compute_loss on one (the whole) batch, with the model's per-token log-probs
    replaced by `logp` (the part that runs a transformers model)."""
    from accelerate import Accelerator
    from trl import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)  # the loss code only, no model or dataset to load
    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    trainer.__dict__.update(
        args=args, loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        max_completion_length=MAX_LEN, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", use_vllm=False, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        current_gradient_accumulation_steps=1, accelerator=Accelerator(cpu=True),
        model=SimpleNamespace(training=True), _metrics={"train": __import__("collections").defaultdict(list)})
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return trainer._compute_loss(None, inputs), trainer._metrics["train"]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_loss_equals_trl(loss_type, beta):
    logp, old, ref, mask, advantages = rollout_tensors()
    ours_logp = logp.clone().requires_grad_()
    totals = BatchTotals(num_sequences=B, num_completion_tokens=int(mask.sum()), max_completion_length=MAX_LEN)
    weights = token_weights(loss_type, mask.sum(-1, keepdim=True).expand(B, T), totals) * mask
    ours, stats = policy_loss(ours_logp, old, advantages[:, None], weights, 0.2, 0.28, beta, ref)
    ours.backward()

    theirs_logp = logp.clone().requires_grad_()
    theirs, metrics = trl_loss(loss_type, beta, theirs_logp, old, ref, mask, advantages)
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-6
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, rtol=0, atol=1e-6)
    if loss_type in ("bnpo", "dapo"):  # TRL's metrics are token means: comparable under token weights
        assert abs(stats["clipped"].item() - metrics["clip_ratio/region_mean"][0]) <= 1e-6
        if beta:
            assert abs(stats["kl"].item() - metrics["kl"][0]) <= 1e-6


def test_advantages_equal_trl_and_dr_grpo_is_mean_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0])
    grouped = rewards.view(-1, 4)
    # TRL's formula (grpo_trainer._generate_and_score_completions, scale_rewards="group")
    expected = (rewards - grouped.mean(1).repeat_interleave(4)) / (grouped.std(1).repeat_interleave(4) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 4), expected)
    torch.testing.assert_close(group_advantages(rewards, 4, scale_by_std=False),
                               rewards - grouped.mean(1).repeat_interleave(4))
    assert group_advantages(rewards, 4)[4:8].abs().max() == 0  # equal rewards: no signal
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(rewards, 5)


def test_token_log_probs_match_log_softmax_in_chunks():
    logits = torch.randn(3, 7, 50)
    targets = torch.randint(0, 50, (3, 7))
    logp, entropy = token_log_probs(logits, targets, chunk_rows=4)
    log_probs = logits.log_softmax(-1)
    torch.testing.assert_close(logp, log_probs.gather(-1, targets[..., None]).squeeze(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=0, atol=1e-5)


def test_k3_is_nonnegative_and_zero_at_equality():
    logp = torch.randn(100)
    assert (k3_kl(logp, logp + torch.randn(100)) >= 0).all()
    assert k3_kl(logp, logp).abs().max() == 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_weights_split_over_micro_batches(loss_type):
    """The loss of the whole batch equals the sum of its pieces' losses, for every split."""
    logp, old, ref, mask, advantages = rollout_tensors(1)
    totals = BatchTotals(B, int(mask.sum()), MAX_LEN)
    lengths = mask.sum(-1, keepdim=True).expand(B, T)

    def piece(rows):
        w = token_weights(loss_type, lengths[rows], totals) * mask[rows]
        return policy_loss(logp[rows], old[rows], advantages[rows, None], w, 0.2, 0.2, 0.1, ref[rows])[0]

    whole = piece(slice(None))
    for parts in (2, 4):
        split = sum(piece(slice(i, i + B // parts)) for i in range(0, B, B // parts))
        assert abs(split.item() - whole.item()) <= 1e-6 * abs(whole.item())
