"""model/kernels.py: our AVX-512 decode attention over MLA latents against PyTorch's attention."""

import pytest
import torch
import torch.nn.functional as F

from seekforge.config import preset
from seekforge.model import kernels
from seekforge.model.model import build_model

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or not kernels.build(),
                                reason="the kernel needs an AVX-512 CPU and a C++ toolchain")


def reference(q, latents, lengths, scale, value_dim):
    """fp32 softmax attention of q (B, M, D) over each sequence's first lengths[b] latents (B, S, D)."""
    keep = None if lengths is None else (torch.arange(latents.shape[1]) < lengths[:, None])[:, None, None, :]
    q, latents = q.float()[:, None], latents.float()[:, None]
    return F.scaled_dot_product_attention(q, latents, latents, attn_mask=keep, scale=scale)[:, 0, :, :value_dim]


@pytest.mark.parametrize("rows, seq, width, value_dim",
                         [(8, 192, 576, 512), (3, 37, 160, 128), (11, 1, 40, 32), (5, 9, 40, 24)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_latent_attention_equals_softmax_attention(rows, seq, width, value_dim, dtype, tol):
    """Query rows in blocks of 8 and a remainder, latent rows in pairs and an odd one, per-sequence lengths,
    strided latents (a view of wider dense rows, as serving's are)."""
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(5, seq + 7, width, generator=gen).to(dtype)[:, :seq]
    q = torch.randn(5, rows, width, generator=gen).to(dtype)
    for lengths in (None, torch.randint(1, seq + 1, (5,), generator=gen)):
        out = torch.ops.seekforge.latent_attention(q, latents, lengths, 0.1, value_dim)
        assert out.dtype == dtype and out.shape == (5, rows, value_dim)
        torch.testing.assert_close(out.float(), reference(q, latents, lengths, 0.1, value_dim), atol=tol, rtol=tol)


def test_latent_attention_compiles():
    """torch.compile traces it through its shape function and calls the kernel (serving's compiled decode)."""
    q, latents = torch.randn(4, 8, 160), torch.randn(4, 24, 160)
    lengths = torch.tensor([24, 3, 17, 9])
    def attend(q, x, n):
        return torch.ops.seekforge.latent_attention(q, x, n, 0.1, 128) * 2

    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(q, latents, lengths), 2 * reference(q, latents, lengths, 0.1, 128))


def test_absorbed_decode_attention_is_the_same_with_the_kernel(monkeypatch):
    """MLA.attend_absorbed over dense latent rows: the kernel against PyTorch's fused attention, which it replaces."""
    model = build_model(preset("tiny"), seed=0).eval()
    attn = model.layers[0].self_attn
    cfg, gen = model.cfg, torch.Generator().manual_seed(1)
    b, s = 6, 40
    q_nope = torch.randn(b, 1, cfg.num_attention_heads, cfg.qk_nope_head_dim, generator=gen)
    q_pe = torch.randn(b, 1, cfg.num_attention_heads, cfg.qk_rope_head_dim, generator=gen)
    latents = torch.randn(b, s, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=gen)
    c_kv, k_pe = latents[..., :cfg.kv_lora_rank], latents[..., cfg.kv_lora_rank:]
    mask = (torch.arange(s) < torch.tensor([40, 1, 7, 33, 20, 39])[:, None])[:, None, None, :]
    outs = {}
    for ready in (True, False):
        monkeypatch.setattr(kernels, "_loaded", ready)
        with torch.no_grad():
            outs[ready] = attn.attend_absorbed(q_nope, q_pe, c_kv, k_pe, mask=mask, latents=latents)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)
