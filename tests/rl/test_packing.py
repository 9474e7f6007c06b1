"""Packing: rows respect both limits and never cut a sequence; packed log-probs, loss and gradients
equal the unpacked computation (fp32, 1e-5); and the gradient does not depend on how the batch is split
into micro-batches (fp32, 1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from seekforge.rl.algorithm import policy_loss, token_log_probs
from seekforge.rl.packing import pack_bins, pack_sequences, pad_row, row_log_probs
from seekforge.rl.update import LossSettings, accumulate_gradients
from tests.rl.conftest import tiny_model, weighted

SETTINGS = LossSettings(loss_type="grpo", clip_low=0.2, clip_high=0.28, beta=0.05)


def test_pack_bins_limits_and_no_truncation():
    lengths = [5, 9, 3, 12, 1, 7, 7, 2, 30]
    rows = pack_bins(lengths, max_pack_tokens=16, max_pack_count=3)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # every sequence, once
    for r in rows:
        assert len(r) <= 3
        assert sum(lengths[i] for i in r) <= 16 or r == [8]  # the 30-token sequence alone, uncut
    with pytest.raises(ValueError, match="max_pack_count=0"):
        pack_bins(lengths, 16, 0)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def unpacked_loss_and_grad(prompts, completions, batch):
    """The simple path: every sequence alone through model.forward, log-softmax over all logits."""
    model = tiny_model()
    logps = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids = torch.tensor([prompt + completion])
        logits = model(ids)[0, len(prompt) - 1:-1]  # positions predicting the completion
        logp, _ = token_log_probs(logits, torch.tensor(completion))
        logps.append(logp)
        loss, _ = policy_loss(logp, batch.old_logps[i], batch.advantages[i], batch.weights[i], SETTINGS,
                              batch.ref_logps[i])
        loss.backward()
    return logps, grads(model)


@pytest.mark.parametrize("padded", [False, True])
def test_packed_log_probs_loss_and_gradients_equal_unpacked(rollout, padded):
    """padded: each row with a padding document appended (pad_row, what bf16 on a CPU rounds rows up with)."""
    prompts, completions, batch = rollout
    ref_logps, ref_grad = unpacked_loss_and_grad(prompts, completions, batch)
    model = tiny_model()
    rows = pack_sequences(prompts, completions, max_pack_tokens=64, max_pack_count=8)
    assert len(rows) < len(completions)
    if padded:
        rows = [pad_row(row, row.input_ids.shape[1] + 13) for row in rows]
    for row in rows:
        logp, _ = row_log_probs(model, row)
        torch.testing.assert_close(logp, torch.cat([ref_logps[i] for i in row.sequences]), rtol=0, atol=1e-5)
    accumulate_gradients(model, rows, batch, SETTINGS)
    torch.testing.assert_close(grads(model), ref_grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_gradient_is_split_invariant(rollout, loss_type):
    """1, 2 and 4 micro-batches (rows of at most N, N/2, N/4 sequences) give one gradient."""
    prompts, completions, batch = rollout
    settings = LossSettings(loss_type=loss_type, beta=0.05)
    batch = weighted(batch, loss_type)
    n = len(completions)
    result = {}
    for parts in (1, 2, 4):
        model = tiny_model()
        rows = pack_sequences(prompts, completions, max_pack_tokens=10_000, max_pack_count=n // parts)
        assert len(rows) == parts
        accumulate_gradients(model, rows, batch, settings)
        result[parts] = grads(model)
    for parts in (2, 4):
        diff = (result[parts] - result[1]).norm() / result[1].norm()
        assert diff <= 1e-6, f"{parts} micro-batches: relative gradient difference {diff:.2e}"


def test_bf16_rows_in_onednn_sizes_match(rollout):
    """Under bf16 autocast on a CPU the trainer pads rows, document lengths and the head's rows to sizes
    oneDNN has built kernels for (precision.onednn_size): log-probs and gradients as without, within bf16
    rounding."""
    from seekforge.model.precision import onednn_size

    prompts, completions, batch = rollout
    results = []
    for padded in (False, True):
        model = tiny_model()
        rows = pack_sequences(prompts, completions, max_pack_tokens=64, max_pack_count=8)
        if padded:
            rows = [pad_row(row, onednn_size(row.input_ids.shape[1]) + 7) for row in rows]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logps = [row_log_probs(model, row)[0] for row in rows]
            accumulate_gradients(model, rows, batch, SETTINGS)
        results.append((torch.cat(logps), grads(model)))
    (logp, grad), (padded_logp, padded_grad) = results
    torch.testing.assert_close(padded_logp, logp, rtol=0, atol=2e-2)
    assert (padded_grad - grad).norm() <= 2e-2 * grad.norm()
