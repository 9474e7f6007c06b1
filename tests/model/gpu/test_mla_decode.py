"""model/gpu/mla_decode.py: the split-context Triton kernels (interpreted on the CPU) against the torch reference,
a plain per-row computation and the model's absorbed attention; sync-free."""

import pytest
import torch

from seekforge.config import preset
from seekforge.model.gpu import mla_decode as mla_module
from seekforge.model.gpu import triton_ready
from seekforge.model.gpu.mla_decode import mla_decode, mla_decode_reference, mla_decode_triton
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.model.model import MLA

pytestmark = pytest.mark.skipif(not triton_ready(torch.device("cpu")) and not torch.cuda.is_available(),
                                reason="needs Triton (interpreted on the CPU, or a GPU)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rows: 1 key, a whole block, 37 (mid-block, over two 32-key splits), none (a CUDA graph's padding row), the whole
# block table (three splits), 50
CONTEXT_LENS = [1, 16, 37, 0, 96, 50]


def decode_inputs(dtype, nh=20, r=48, dr=8, size=16, width=6, pool=40, lens=CONTEXT_LENS):
    """Random queries and pools; each row's table holds distinct blocks for its context and is padded with
    block 0 past it (any valid block, as the engine pads)."""
    b = len(lens)
    q_latent, q_rope = torch.randn(b, nh, r), torch.randn(b, nh, dr)
    c_kv, k_pe = torch.randn(pool, size, r), torch.randn(pool, size, dr)
    tables = torch.randperm(pool - 1)[:b * width].view(b, width) + 1
    for row, n in enumerate(lens):
        tables[row, -(-n // size):] = 0
    lens = torch.tensor(lens)
    cast = (t.to(DEVICE, dtype) for t in (q_latent, q_rope, c_kv, k_pe))
    return (*cast, tables.to(DEVICE), lens.to(DEVICE), (r + dr) ** -0.5)


def plain(q_latent, q_rope, c_kv, k_pe, tables, lens, scale):
    """Per row, in float64: gather its keys block by block, cut at its length, softmax → (B, nh, r)."""
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    size = c_kv.shape[1]
    for row, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        blocks = tables[row, :-(-n // size)].tolist()
        keys = torch.cat([c_kv[i] for i in blocks])[:n].double()  # (n, r)
        rope_keys = torch.cat([k_pe[i] for i in blocks])[:n].double()  # (n, dr)
        scores = (q_latent[row].double() @ keys.T + q_rope[row].double() @ rope_keys.T) * scale  # (nh, n)
        out[row] = scores.softmax(-1) @ keys
    return out


@pytest.mark.parametrize("num_splits", [None, 3])
def test_kernel_fp32(num_splits):
    inputs = decode_inputs(torch.float32)
    out = mla_decode_triton(*inputs, num_splits=num_splits)
    assert out.dtype == torch.float32 and out.shape == (6, 20, 48)
    torch.testing.assert_close(out, mla_decode_reference(*inputs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double().cpu(), plain(*(x.cpu() if torch.is_tensor(x) else x for x in inputs)),
                               atol=1e-5, rtol=1e-5)
    assert out[3].eq(0).all()  # context 0: zeros


@pytest.mark.parametrize("num_splits", [None, 3])
def test_kernel_bf16(num_splits):
    inputs = decode_inputs(torch.bfloat16)
    out = mla_decode_triton(*inputs, num_splits=num_splits)
    assert out.dtype == torch.bfloat16
    # one rounding of an fp32 result each: at most an ulp of bf16 apart
    torch.testing.assert_close(out.float(), mla_decode_reference(*inputs).float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.double().cpu(), plain(*(x.cpu() if torch.is_tensor(x) else x for x in inputs)),
                               atol=2e-2, rtol=1e-2)
    assert out[3].eq(0).all()


def test_default_split_rule_splits_a_lone_row():
    """One row of one head block: the default rule splits its context (the SMs would idle otherwise); 5 heads,
    r = 40 and dr = 8 are padded inside the kernel to 16, 64 and 16."""
    inputs = decode_inputs(torch.float32, nh=5, r=40, lens=[90])
    assert mla_module.split_count(1, 1, 96, torch.device(DEVICE)) > 1
    torch.testing.assert_close(mla_decode_triton(*inputs), mla_decode_reference(*inputs), atol=1e-5, rtol=1e-5)


def test_strided_views():
    """Pools as views of one [c_kv | k_pe] latents tensor (the dense rows' layout), queries as transposed views,
    an int32 block table: the kernel takes every stride as given."""
    q_latent, q_rope, c_kv, k_pe, tables, lens, scale = decode_inputs(torch.float32, lens=[7, 40])
    latents = torch.cat([c_kv, k_pe], -1)  # (P, L, r + dr)
    inputs = (q_latent.transpose(0, 1).contiguous().transpose(0, 1), q_rope, latents[..., :48], latents[..., 48:],
              tables.int(), lens.int(), scale)
    assert not inputs[0].is_contiguous() and not inputs[2].is_contiguous()
    torch.testing.assert_close(mla_decode_triton(*inputs, num_splits=2), mla_decode_reference(*inputs),
                               atol=1e-5, rtol=1e-5)


def test_launch_is_sync_free():
    """The entry point takes the kernels here (interpreted) and dispatches no host sync: a CUDA graph can
    capture it."""
    inputs = decode_inputs(torch.float32)
    with HostSyncGuard(strict=True) as guard:
        out = mla_decode(*inputs)
    assert guard.syncs == 0
    torch.testing.assert_close(out, mla_decode_reference(*inputs), atol=1e-5, rtol=1e-5)


def test_reference_where_triton_cannot_run(monkeypatch):
    monkeypatch.setattr(mla_module, "triton_ready", lambda device: False)
    inputs = decode_inputs(torch.float32, lens=[3, 0])
    assert mla_decode(*inputs).equal(mla_decode_reference(*inputs))


@torch.no_grad()
def test_matches_the_models_absorbed_attention():
    """The kernel is the middle of MLA.attend_absorbed: q_nope folded through w_uk, the kernel over the paged
    latents, the output unfolded through w_uv equals attend_absorbed over the same latents gathered dense."""
    attn = MLA(preset("tiny")).to(DEVICE)  # nh 4, r 32, dr 8, dn = dv = 16
    cfg, nh = attn.cfg, attn.num_heads
    lens = [5, 16, 23]
    b, size, width = len(lens), 8, 3
    c_kv, k_pe = torch.randn(12, size, cfg.kv_lora_rank), torch.randn(12, size, cfg.qk_rope_head_dim)
    tables = torch.randperm(12)[:b * width].view(b, width)
    q_nope, q_pe = torch.randn(b, 1, nh, cfg.qk_nope_head_dim), torch.randn(b, 1, nh, cfg.qk_rope_head_dim)
    mask = (torch.arange(width * size) < torch.tensor(lens)[:, None])[:, None, None, :]  # (B, 1, 1, S)
    c_kv, k_pe, tables, q_nope, q_pe, mask = (t.to(DEVICE) for t in (c_kv, k_pe, tables, q_nope, q_pe, mask))
    expected = attn.attend_absorbed(q_nope, q_pe, c_kv[tables].flatten(1, 2), k_pe[tables].flatten(1, 2), mask=mask)

    w_uk, w_uv = attn.kv_b_weights()  # (nh, dn, r), (nh, dv, r)
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope[:, 0], w_uk)  # (B, nh, r)
    out_latent = mla_decode(q_latent, q_pe[:, 0], c_kv, k_pe, tables, torch.tensor(lens, device=DEVICE),
                            attn.softmax_scale)
    out = torch.einsum("bhr,hvr->bhv", out_latent, w_uv).reshape(b, 1, -1)  # (B, 1, nh·dv)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
