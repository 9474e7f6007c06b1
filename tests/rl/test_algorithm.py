"""GRPO's pure functions: each loss type and option equals TRL's GRPOTrainer loss (its own `_compute_loss`, fed
our per-token log-probs), advantages equal TRL's, the token weights split over rows exactly, and bnpo and the
high-entropy mask follow TRL's micro-batches. (tests/rl/test_trl_end_to_end.py runs TRL's whole trainer.)"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from seekforge.rl.algorithm import (
    LossSettings,
    group_advantages,
    high_entropy_masks,
    k3_kl,
    policy_loss,
    sequence_weights,
    token_log_probs,
    token_share,
)

B, T, G, MAX_LEN = 8, 6, 4, 6


def rollout_tensors(seed: int = 0):
    """Per-token log-probs (B, T) for the current, old and reference policy, a completion mask with
    different lengths, per-sequence advantages and per-token entropies."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64).float() * 3
    old = logp + 0.3 * torch.randn(B, T, generator=gen)  # far enough that both clips trigger
    ref = logp + 0.2 * torch.randn(B, T, generator=gen)
    lengths = torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])
    mask = (torch.arange(T) < lengths[:, None]).float()
    rewards = torch.randint(0, 2, (B,), generator=gen).float()
    advantages = group_advantages(rewards, G)
    entropy = torch.rand(B, T, generator=gen) * 5
    return logp, old, ref, mask, advantages, entropy


def trl_loss(settings: LossSettings, logp, old, ref, mask, advantages, entropy, quantile=1.0, accumulation=1):
    """TRL's GRPOTrainer._compute_loss on one micro-batch, with the model's per-token log-probs and entropies
    replaced by `logp` and `entropy` (the part that runs a transformers model)."""
    from accelerate import Accelerator
    from trl import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)  # the loss code only, no model or dataset to load
    args = SimpleNamespace(use_bias_correction_kl=settings.use_bias_correction_kl, delta=settings.delta,
                           steps_per_generation=accumulation, sapo_temperature_pos=settings.sapo_temperature_pos,
                           sapo_temperature_neg=settings.sapo_temperature_neg)
    trainer.__dict__.update(
        args=args, loss_type=settings.loss_type, beta=settings.beta, epsilon_low=settings.clip_low,
        epsilon_high=settings.clip_high, max_completion_length=MAX_LEN, top_entropy_quantile=quantile,
        off_policy_mask_threshold=None, importance_sampling_level=settings.importance_sampling_level, use_vllm=False,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, current_gradient_accumulation_steps=accumulation,
        accelerator=Accelerator(cpu=True), model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)})
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    n = logp.shape[0]
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1),
              "completion_ids": torch.zeros(n, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(float(accumulation)) * mask.sum()}
    return trainer._compute_loss(None, inputs), trainer._metrics["train"]


def ours(settings: LossSettings, logp, old, ref, mask, advantages, entropy, quantile=1.0, micro_batch_size=0):
    """Our loss on the flat completion tokens (what a packed row holds) → (loss, token-mean stats)."""
    lengths = mask.sum(-1).long()
    owner = torch.arange(B)[:, None].expand(B, T)[mask.bool()]
    weights = sequence_weights(settings.loss_type, lengths, MAX_LEN, micro_batch_size=micro_batch_size)[owner]
    policy_mask = None
    if quantile < 1:
        entropies = [entropy[i, :lengths[i]] for i in range(B)]
        policy_mask = torch.cat(high_entropy_masks(entropies, [True] * B, micro_batch_size, quantile))
    flat = mask.bool()
    loss, stats = policy_loss(logp[flat], old[flat], advantages[owner], weights, settings, ref[flat], owner, B,
                              policy_mask)
    share = token_share(lengths)[owner]
    return loss, {key: (value * share).sum().item() for key, value in stats.items()}


CASES = [LossSettings(loss_type, beta=beta) for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo") for beta in (0, .04)]
CASES += [
    LossSettings("dapo", beta=0.04, use_bias_correction_kl=True),
    LossSettings("grpo", beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"),
    LossSettings("dapo", importance_sampling_level="sequence"),
    LossSettings("dapo", beta=0.04, delta=1.3),
    LossSettings("cispo", clip_high=1.2, beta=0.04),
    LossSettings("cispo", clip_high=1.2, importance_sampling_level="sequence"),
    LossSettings("sapo", beta=0.04, use_bias_correction_kl=True),
]


def short(settings: LossSettings) -> str:
    """A case's test id: its fields that differ from the defaults."""
    default = LossSettings()
    return "-".join(f"{k}={v}" for k, v in vars(settings).items() if v != getattr(default, k) or k == "loss_type")


@pytest.mark.parametrize("settings", CASES, ids=short)
def test_loss_equals_trl(settings):
    logp, old, ref, mask, advantages, entropy = rollout_tensors()
    ours_logp = logp.clone().requires_grad_()
    loss, stats = ours(settings, ours_logp, old, ref, mask, advantages, entropy)
    loss.backward()

    theirs_logp = logp.clone().requires_grad_()
    theirs, metrics = trl_loss(settings, theirs_logp, old, ref, mask, advantages, entropy)
    theirs.backward()
    assert abs(loss.item() - theirs.item()) <= 1e-6
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, rtol=0, atol=1e-6)
    # the logged statistics are token means, as TRL's (its clip fraction at sequence level is per sequence)
    if settings.loss_type not in ("cispo", "sapo") and settings.importance_sampling_level == "token":
        assert abs(stats["clipped"] - metrics["clip_ratio/region_mean"][0]) <= 1e-6
    if settings.loss_type == "cispo" and settings.importance_sampling_level == "token":
        assert abs(stats["clipped"] - metrics["cispo_clip_ratio"][0]) <= 1e-6
    if settings.beta:
        assert abs(stats["kl"] - metrics["kl"][0]) <= 1e-6


@pytest.mark.parametrize("loss_type, quantile", [("bnpo", 1.0), ("dapo", 0.4), ("bnpo", 0.25)])
def test_micro_batches_equal_trl(loss_type, quantile):
    """bnpo normalizes each micro-batch by its own tokens, and the high-entropy threshold is each micro-batch's:
    two micro-batches of 4 sequences, as TRL's two accumulation steps of per_device_train_batch_size=4."""
    settings = LossSettings(loss_type, beta=0.04)
    logp, old, ref, mask, advantages, entropy = rollout_tensors(2)
    ours_logp = logp.clone().requires_grad_()
    loss, _ = ours(settings, ours_logp, old, ref, mask, advantages, entropy, quantile, micro_batch_size=4)
    loss.backward()
    theirs_logp = logp.clone().requires_grad_()
    halves = [slice(0, 4), slice(4, 8)]
    tokens = mask.sum()  # TRL's num_items_in_batch spans the generation batch: the two micro-batches
    theirs = 0.0
    for half in halves:
        part, _ = trl_loss(settings, theirs_logp[half], old[half], ref[half], mask[half], advantages[half],
                           entropy[half], quantile, accumulation=2)
        if loss_type == "dapo":  # fed one micro-batch, TRL's dapo normalizer is that micro-batch's count × 2
            part = part * (2 * mask[half].sum()) / tokens
        theirs = theirs + part
    theirs.backward()
    assert abs(loss.item() - theirs.item()) <= 1e-6
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, rtol=0, atol=1e-6)
    if loss_type == "bnpo":  # and differs from the whole batch's normalization (bnpo with one micro-batch)
        whole, _ = ours(settings, logp, old, ref, mask, advantages, entropy, quantile)
        assert abs(whole.item() - loss.item()) > 1e-4


def test_advantages_equal_trl():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0])
    grouped = rewards.view(-1, 4)
    centered = rewards - grouped.mean(1).repeat_interleave(4)
    # TRL's formulas (grpo_trainer._generate_and_score_completions, scale_rewards "group" / "batch" / "none")
    torch.testing.assert_close(group_advantages(rewards, 4), centered / (grouped.std(1).repeat_interleave(4) + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, 4, "batch"), centered / (rewards.std() + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, 4, "none"), centered)
    torch.testing.assert_close(group_advantages(rewards, 4, True), group_advantages(rewards, 4, "group"))
    torch.testing.assert_close(group_advantages(rewards, 4, False), centered)
    assert group_advantages(rewards, 4)[4:8].abs().max() == 0  # equal rewards: no signal
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(rewards, 5)
    with pytest.raises(ValueError, match="scale_rewards='global'"):
        group_advantages(rewards, 4, "global")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_log_probs_match_log_softmax_in_chunks(temperature):
    logits = torch.randn(3, 7, 50)
    targets = torch.randint(0, 50, (3, 7))
    logp, entropy = token_log_probs(logits, targets, chunk_rows=4, temperature=temperature)
    log_probs = (logits / temperature).log_softmax(-1)
    torch.testing.assert_close(logp, log_probs.gather(-1, targets[..., None]).squeeze(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=0, atol=1e-5)


def test_k3_is_nonnegative_and_zero_at_equality():
    logp = torch.randn(100)
    assert (k3_kl(logp, logp + torch.randn(100)) >= 0).all()
    assert k3_kl(logp, logp).abs().max() == 0


@pytest.mark.parametrize("settings", [LossSettings("grpo", beta=0.1), LossSettings("bnpo", beta=0.1),
                                      LossSettings("dr_grpo", beta=0.1),
                                      LossSettings("dapo", importance_sampling_level="sequence")], ids=short)
def test_weights_split_over_rows(settings):
    """The loss of the whole batch equals the sum of its pieces' losses, for every split into rows of whole
    sequences (a row never cuts one)."""
    logp, old, ref, mask, advantages, _ = rollout_tensors(1)
    lengths = mask.sum(-1).long()
    weights = sequence_weights(settings.loss_type, lengths, MAX_LEN, micro_batch_size=4)

    def piece(rows):
        owner = torch.arange(B)[rows, None].expand(-1, T)[mask[rows].bool()]
        flat = mask[rows].bool()
        return policy_loss(logp[rows][flat], old[rows][flat], advantages[owner], weights[owner], settings,
                           ref[rows][flat], owner, B)[0]

    whole = piece(slice(None))
    for parts in (2, 4):
        split = sum(piece(slice(i, i + B // parts)) for i in range(0, B, B // parts))
        torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)  # fp32 sums of terms of both signs


def test_masked_sequences_get_no_weight_but_count_where_trl_counts_them():
    """mask_truncated_completions: a masked sequence's tokens weigh 0; grpo still divides by all N sequences
    and dr_grpo by N · max length (TRL's means over the rows), dapo by the remaining tokens."""
    lengths = torch.tensor([2, 4, 6, 8])
    scored = torch.tensor([True, False, True, True])
    assert sequence_weights("grpo", lengths, 8, scored).tolist() == pytest.approx([1 / 8, 0, 1 / 24, 1 / 32])
    assert sequence_weights("dr_grpo", lengths, 8, scored).tolist() == pytest.approx([1 / 32, 0, 1 / 32, 1 / 32])
    assert sequence_weights("dapo", lengths, 8, scored).tolist() == pytest.approx([1 / 16, 0, 1 / 16, 1 / 16])
    assert sequence_weights("bnpo", lengths, 8, scored, 2).tolist() == pytest.approx([1 / 4, 0, 1 / 28, 1 / 28])
    assert token_share(lengths, scored).tolist() == pytest.approx([1 / 16, 0, 1 / 16, 1 / 16])
