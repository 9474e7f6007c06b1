"""A transformer block on the GPU path (RMSNorm as F.rms_norm, attention through SDPA with v zero-padded to
q's head dim so that CUDA's flash kernel takes it), run on CPU tensors inside `forced_gpu_path()`: the CPU
path's output and gradients, and no host sync."""

import torch

from seekforge.config import preset
from seekforge.model.gpu import forced_gpu_path
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.model.model import Block
from seekforge.model.rope import RotaryEmbedding


def test_block_forward_and_backward_equal_the_cpu_path():
    cfg = preset("tiny")  # q/k head dim 24 (16 + 8), v 16
    block = Block(cfg, layer_id=0).train()  # a dense layer: MLA, norms and the SwiGLU MLP
    gen = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    cos, sin = RotaryEmbedding(cfg)(torch.arange(12))
    x = torch.randn(2, 12, cfg.hidden_size, generator=gen)

    def run():
        block.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_()
        out = block(h, cos, sin)
        out.square().mean().backward()
        return [out.detach(), h.grad] + [p.grad for p in block.parameters()]

    cpu = run()
    with forced_gpu_path(), HostSyncGuard(strict=True) as guard:
        gpu = run()
    assert guard.counts["aten::_scaled_dot_product_flash_attention_for_cpu"] == 1
    for got, want in zip(gpu, cpu, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
