"""gpu/fused_moe.py: the alignment's invariants, the two Triton kernels against the torch reference (in Triton's
interpreter here, on the GPU where there is one), sync-freedom, and equality with MoE's own dispatch path."""

import pytest
import torch

from seekforge.config import preset
from seekforge.model import moe as moe_module
from seekforge.model.gpu import forced_gpu_path, triton_ready
from seekforge.model.gpu import fused_moe as fused
from seekforge.model.gpu.fused_moe import (
    MoeBlocks,
    align_tokens,
    fused_moe,
    fused_moe_reference,
    fused_moe_triton,
    max_tiles,
)
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.model.model import build_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_ready(DEVICE), reason="Triton not installed (the test extra)")


def routing(case: str, n: int, k: int, e: int) -> torch.Tensor:
    """(N, K) expert ids: random distinct experts per token, or a skewed routing."""
    g = torch.Generator().manual_seed(n * 100 + k)
    if case == "one_expert":  # every copy to expert 3 (repeats within a token are valid math)
        return torch.full((n, k), 3, device=DEVICE)
    if case == "empty_expert":  # experts 0 and e-1 get nothing
        return torch.stack([torch.randperm(e - 2, generator=g)[:k] + 1 for _ in range(n)]).to(DEVICE)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEVICE)


def problem(n, k, e, hidden, inter, dtype, case="random"):
    g = torch.Generator().manual_seed(n + hidden)
    x = torch.randn(n, hidden, generator=g)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(e, hidden, inter, generator=g) / inter ** 0.5
    weights = torch.rand(n, k, generator=g)
    tensors = [t.to(DEVICE, dtype) for t in (x, gate_up, down)]
    return (*tensors, weights.to(DEVICE), routing(case, n, k, e))


@pytest.mark.parametrize("case,n,k,e,block_m", [
    ("random", 1, 8, 256, 16), ("random", 37, 4, 8, 16), ("empty_expert", 20, 4, 16, 32), ("one_expert", 9, 4, 8, 16),
])
def test_alignment_invariants(case, n, k, e, block_m):
    """Every copy exactly once, grouped by expert in copy order; every real tile of one expert; padding rows
    hold the sentinel S; the shapes follow N, K, E and BLOCK_M only; no host sync."""
    indices = routing(case, n, k, e)
    with HostSyncGuard(strict=True):
        sorted_ids, tile_expert, num_tiles = align_tokens(indices, e, block_m)
    s, tiles = n * k, max_tiles(n * k, e, block_m)
    assert sorted_ids.shape == (tiles * block_m,) and tile_expert.shape == (tiles,) and num_tiles.shape == (1,)
    flat = indices.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=e)
    assert int(num_tiles) == int(((counts + block_m - 1) // block_m).sum())
    ids = sorted_ids.cpu().long()
    real = ids < s
    assert (ids[~real] == s).all()  # padding rows: the out-of-range sentinel
    assert torch.equal(ids[real].sort().values, torch.arange(s))  # every copy exactly once
    assert torch.equal(ids[real], flat.argsort(stable=True))  # by expert, then copy order
    for t in range(tiles):
        tile = ids[t * block_m:(t + 1) * block_m]
        if t >= int(num_tiles):
            assert (tile == s).all()  # past the real tiles: padding only
            continue
        copies = tile[tile < s]
        assert copies.numel() > 0 and (flat[copies] == int(tile_expert[t])).all()  # one expert per tile


CASES = [  # n, k, e, hidden, inter, routing: sizes H, I not multiples of the blocks (16 or 64)
    (1, 8, 16, 80, 40, "random"),
    (3, 4, 8, 48, 24, "random"),
    (37, 4, 8, 80, 40, "random"),
    (6, 4, 16, 80, 40, "empty_expert"),
    (5, 2, 8, 48, 24, "one_expert"),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("n,k,e,hidden,inter,case", CASES)
def test_kernels_equal_reference(n, k, e, hidden, inter, case, dtype, tol):
    """The blocks moe_blocks picks (64 here: H = 80 spans a full and a partial block) and 16³ blocks (several
    reduction steps, partial last ones): both within fp32 rounding of the reference, or bf16's (one rounding
    of the activation and of the output; the reference keeps the activation in fp32)."""
    x, gate_up, down, weights, indices = problem(n, k, e, hidden, inter, dtype, case)
    expected = fused_moe_reference(x, gate_up, down, weights, indices).float()
    for blocks in (None, MoeBlocks(16, 16, 16)):
        out = fused_moe_triton(x, gate_up, down, weights, indices, blocks)
        assert out.dtype == dtype and out.shape == (n, hidden)
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_fused_moe_launch_is_sync_free(monkeypatch):
    """The whole launch (alignment, both kernels, the sum of the copies) without a host sync, by the kernels."""
    monkeypatch.setattr(fused, "fused_moe_reference", None)  # not the reference's path
    x, gate_up, down, weights, indices = problem(7, 4, 16, 48, 24, torch.float32)
    with HostSyncGuard(strict=True) as guard:
        out = fused_moe(x, gate_up, down, weights, indices)
    assert guard.syncs == 0
    monkeypatch.undo()
    torch.testing.assert_close(out, fused_moe_reference(x, gate_up, down, weights, indices), atol=1e-5, rtol=1e-5)


def tiny_moe(dtype: torch.dtype):
    """A tiny model's MoE layer (8 experts, top-2, H 64, I 32), eval, on DEVICE."""
    cfg = preset("tiny")
    return build_model(cfg, dtype=dtype).layers[1].mlp.eval().to(DEVICE), cfg


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("n", [1, 13])
def test_fused_moe_equals_moe_dispatch(n, dtype, tol):
    """fused_moe against the model's general routed path: LocalDispatcher.dispatch → GroupedExperts.forward →
    combine, on the same tokens and routing (bf16: that path rounds the SwiGLU's inputs and each copy's product
    to bf16, the kernels only the activation)."""
    moe, cfg = tiny_moe(dtype)
    x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
    with torch.no_grad():
        weights, indices, _ = moe.gate(x)
        routed, counts, state = moe.dispatcher.dispatch(x, indices, cfg.n_routed_experts)
        expected = moe.dispatcher.combine(moe.experts(routed, counts), state, weights)
        out = fused_moe(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, indices)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(not triton_ready(torch.device("cpu")), reason="the GPU path forced on CPU tensors: interpreter")
@pytest.mark.parametrize("n", [1, 5])
def test_moe_layer_takes_fused_moe_on_the_gpu_path(n, monkeypatch):
    """A MoE layer in eval/no_grad: inside forced_gpu_path its routed experts run fused_moe (once), outside it
    the CPU paths (forward_one_token, forward_batched, the loop) as before, with the same output; more tokens
    than MAX_FUSED_MOE_TOKENS take the other paths on the GPU path too."""
    calls = []
    monkeypatch.setattr(moe_module, "fused_moe", lambda *a: calls.append(a) or fused_moe(*a))
    moe, cfg = tiny_moe(torch.float32)
    moe.cpu()
    x = torch.randn(1, n, cfg.hidden_size, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        cpu = moe(x)
        assert not calls
        with forced_gpu_path():
            gpu = moe(x)
            assert len(calls) == 1
            monkeypatch.setattr(moe_module, "MAX_FUSED_MOE_TOKENS", n - 1)
            moe(x)
            assert len(calls) == 1
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-5)
