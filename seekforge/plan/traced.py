"""Traced memory: run the real model's training step under FakeTensorMode and count what it keeps.

No tensor holds data, so a model of any size traces on a laptop: the parameters, the AdamW states,
every activation the real forward saves and every gradient are fake tensors with real sizes, and
`LiveBytes` (plan/measure.py) records the peak of their storages. Routing is the one data-dependent
step: `torch.bincount` (the tokens per expert) is replaced, inside the trace only, by a balanced
count, which is what the analytic model assumes too (moe_skew = 1).

Scope: one device (the single-device trainer's step: bf16 autocast over fp32 weights, the model/loss
objective, fused AdamW, recompute applied as parallel/recompute.py does). The parallel wrappers need
process groups, which a trace does not have; plan/memory.py covers those layouts.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from seekforge.config import ModelConfig
from seekforge.plan.measure import LiveBytes


@contextmanager
def _balanced_routing():
    """torch.bincount(x, minlength=E) → E near-equal counts summing to x.numel(), as a real tensor
    (so `.tolist()` works while everything around it is fake)."""
    original = torch.bincount

    def bincount(input, weights=None, minlength=0):
        n, bins = input.numel(), max(minlength, 1)
        with unset_fake_temporarily():
            return torch.tensor([n // bins + (1 if e < n % bins else 0) for e in range(bins)])

    torch.bincount = bincount
    try:
        yield
    finally:
        torch.bincount = original


def traced_peak(cfg: ModelConfig, micro_batch_size: int, seq_len: int, dtype: str = "bf16",
                recompute: str = "none", mtp_loss_scale: float = 0.3) -> int:
    """Peak live bytes of the second training step (the first creates the optimizer states)."""
    from seekforge.model.loss import lm_loss
    from seekforge.model.model import Transformer
    from seekforge.parallel.recompute import apply_recompute

    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: use 'bf16' (autocast) or 'fp32'")
    with FakeTensorMode(allow_non_fake_inputs=True), _balanced_routing():
        model = Transformer(cfg).init_buffers()
        if recompute != "none":
            apply_recompute(model, recompute)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.zeros(micro_batch_size, seq_len + 1, dtype=torch.long)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()

        def step():
            with autocast:
                loss, _ = lm_loss(model, ids[:, :-1], ids[:, 1:], mtp_loss_scale=mtp_loss_scale)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        existing = [*model.parameters(), *model.buffers()]
        existing += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        with LiveBytes(existing) as tracker:
            step()
    return tracker.peak
