"""model/gpu/cross_entropy.py: the fused linear + cross-entropy (Triton kernel in its interpreter) against the
reference the CPU trains with, model/loss.py's cross_entropy(F.linear(h, W)), forward and gradients, with no
host sync; and the objective taking it on the GPU path."""

import pytest
import torch
import torch.nn.functional as F

from seekforge.config import preset
from seekforge.model.gpu import forced_gpu_path, triton_ready
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.model.loss import IGNORE_INDEX, cross_entropy, lm_loss
from seekforge.model.model import build_model

pytestmark = pytest.mark.skipif(not triton_ready(torch.device("cpu")), reason="needs triton (interpreted on CPU)")

N, H, V = 37, 24, 300  # N not a multiple of the chunks below, V not a multiple of any power-of-two block


def _inputs(ignored: str):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    labels = torch.randint(0, V, (N,), generator=gen)
    if ignored == "some":
        labels[::4] = IGNORE_INDEX
    elif ignored == "all":
        labels[:] = IGNORE_INDEX
    return hidden, weight, labels


def _loss_and_grads(fn, hidden, weight, labels, autocast: bool):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _reference(h, w, labels):
    return cross_entropy(F.linear(h, w), labels)


@pytest.mark.parametrize("rows", [10, None])  # 4 chunks, the last short; one chunk (the default size)
@pytest.mark.parametrize("autocast, tol", [(False, 1e-5), (True, 2e-2)])
def test_fused_equals_the_reference(rows, autocast, tol):
    from seekforge.model.gpu.cross_entropy import fused_linear_cross_entropy

    hidden, weight, labels = _inputs("some")
    with HostSyncGuard(strict=True):
        fused = _loss_and_grads(lambda h, w, y: fused_linear_cross_entropy(h, w, y, rows=rows), hidden, weight,
                                labels, autocast)
    ref = _loss_and_grads(_reference, hidden, weight, labels, autocast)
    for name, got, want in zip(("loss", "grad h", "grad W"), fused, ref, strict=True):
        assert got.dtype == want.dtype == torch.float32, name
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item(), msg=name)


def test_every_row_ignored_is_nan_with_zero_gradients():
    """0/0 = nan like F.cross_entropy, whose gradients are then zero (the chunked reference's are nan)."""
    from seekforge.model.gpu.cross_entropy import fused_linear_cross_entropy

    hidden, weight, labels = _inputs("all")
    loss, grad_h, grad_w = _loss_and_grads(lambda h, w, y: fused_linear_cross_entropy(h, w, y, rows=16), hidden,
                                           weight, labels, False)
    _, want_h, want_w = _loss_and_grads(lambda h, w, y: F.cross_entropy(F.linear(h, w), y), hidden, weight, labels,
                                        False)
    assert loss.isnan()
    torch.testing.assert_close(grad_h, want_h)
    torch.testing.assert_close(grad_w, want_w)


def test_no_gradients_computed_under_no_grad(monkeypatch):
    """An evaluation's loss skips the two gradient matmuls per chunk."""
    from seekforge.model.gpu import cross_entropy as fused_module

    needed, original = [], fused_module._loss_and_gradients
    monkeypatch.setattr(fused_module, "_loss_and_gradients", lambda *a: needed.append(a[-2:]) or original(*a))
    hidden, weight, labels = _inputs("some")
    hidden.requires_grad_(), weight.requires_grad_()
    with torch.no_grad():
        loss = fused_module.fused_linear_cross_entropy(hidden, weight, labels)
    assert needed == [(False, False)]
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(hidden, weight), labels))


@pytest.mark.parametrize("rows", [N, 150])  # one program of 64 rows, part empty; three (150 = 2·64 + 22)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_its_reference_across_blocks(dtype, rows):
    """The row kernel with a block that leaves a partial last block (300 = 2·128 + 44), bf16 through UPCAST."""
    from seekforge.model.gpu.cross_entropy import loss_and_grad_rows_, loss_and_grad_rows_reference

    hidden, weight, labels = _inputs("some")
    hidden, labels = hidden.repeat(5, 1)[:rows], labels.repeat(5)[:rows]
    logits = F.linear(hidden, weight).to(dtype)
    count = (labels != IGNORE_INDEX).sum()
    want_grad, want_loss = loss_and_grad_rows_reference(logits, labels, count, IGNORE_INDEX)
    loss = torch.empty(rows)
    loss_and_grad_rows_(logits, labels, count, loss, IGNORE_INDEX, block=128)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss, want_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(logits.float(), want_grad.float(), rtol=tol, atol=tol * want_grad.abs().max().item())


def test_objective_takes_the_fused_path_on_the_gpu_path(monkeypatch):
    """lm_loss on the GPU path (lm + MTP heads fused) equals the CPU path's, loss and gradients."""
    model = build_model(preset("tiny"), seed=0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX

    def run():
        model.zero_grad(set_to_none=True)
        loss, parts = lm_loss(model, ids, labels)
        loss.backward()
        return parts, model.lm_head.weight.grad.clone(), model.embed_tokens.weight.grad.clone()

    cpu = run()
    from seekforge.model.gpu import cross_entropy as fused_module

    calls, original = [], fused_module.fused_linear_cross_entropy
    counted = lambda *a, **k: calls.append(1) or original(*a, **k)  # noqa: E731
    monkeypatch.setattr(fused_module, "fused_linear_cross_entropy", counted)
    with forced_gpu_path():
        gpu = run()
    assert len(calls) == 2  # the main head and the MTP depth
    for name in ("lm_loss", "mtp_loss"):
        torch.testing.assert_close(gpu[0][name], cpu[0][name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gpu[1], cpu[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gpu[2], cpu[2], rtol=1e-4, atol=1e-6)
