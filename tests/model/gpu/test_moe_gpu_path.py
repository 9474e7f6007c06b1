"""model/moe.py's training dispatch on the GPU path (counts by scatter-add, torch._grouped_mm with offsets on
the device), run on CPU tensors inside `forced_gpu_path()`: no host sync, and the CPU path's output, gradients,
expert counts and balance loss."""

import pytest
import torch

from seekforge.config import preset
from seekforge.model.gpu import forced_gpu_path
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.model.moe import MoE, count_per_expert


def test_count_per_expert_equals_bincount():
    flat = torch.tensor([3, 0, 3, 5, 0, 3])
    with forced_gpu_path(), HostSyncGuard(strict=True):
        counts = count_per_expert(flat, 8)
    assert counts.tolist() == torch.bincount(flat, minlength=8).tolist()
    assert counts.dtype == torch.long


def _run(moe: MoE, x: torch.Tensor, autocast: bool):
    moe.zero_grad(set_to_none=True)
    moe.tokens_per_expert.zero_()
    moe.aux_loss = 0.0
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = moe(x)
    out.float().square().mean().backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return out.detach().float(), x.grad, grads, moe.tokens_per_expert.clone(), moe.aux_loss.clone()


@pytest.mark.parametrize("autocast, tol", [(False, 1e-5), (True, 2e-2)])
def test_moe_training_forward_and_backward_equal_the_cpu_path(autocast, tol):
    cfg = preset("tiny")  # 8 routed experts top-2 in 2 groups, a shared expert
    moe = MoE(cfg).train()
    gen = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    moe.aux_loss_coeff = 1e-2
    x = torch.randn(2, 24, cfg.hidden_size, generator=gen)
    cpu = _run(moe, x, autocast)
    with forced_gpu_path(), HostSyncGuard(strict=True) as guard:
        gpu = _run(moe, x, autocast)
    assert guard.counts["aten::_grouped_mm"] == 6  # per projection: one forward, two backward (grad x, grad W)
    out, grad_x, grads, counts, aux = gpu
    torch.testing.assert_close(out, cpu[0], rtol=tol, atol=tol)
    torch.testing.assert_close(grad_x, cpu[1], rtol=tol, atol=tol)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, cpu[2][name], rtol=tol, atol=tol * cpu[2][name].abs().max().item(), msg=name)
    assert counts.tolist() == cpu[3].tolist()
    torch.testing.assert_close(aux, cpu[4])
