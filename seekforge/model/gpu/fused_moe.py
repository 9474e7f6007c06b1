"""The routed experts of a decode-sized batch, for the GPU path: every (token, chosen expert) pair in two
kernels, as vLLM's and SGLang's `fused_moe`, instead of a sort, two gathers and a grouped GEMM per
projection around them.

Shape legend: N tokens, H hidden, K experts per token, E experts, I expert intermediate size, S = N·K token
copies (copy n·K + k is token n's k-th choice), T tiles of BLOCK_M rows, P = T·BLOCK_M padded rows.

`align_tokens` sorts the copies by expert and pads each expert's group to whole tiles of BLOCK_M rows, so
that every tile multiplies by one expert's weights (fused_moe_kernels.py: kernel 1, x·gate_up → silu·up;
kernel 2, act·down scaled by the router weight, each copy to its own row: no atomics, deterministic); the K
copies of a token are then summed in torch. Everything is sync-free with shapes that depend on N, K, E and
the blocks only, never on the routing: the number of real tiles stays on the device, and programs past it
exit at once. So a decode step with it can be captured in a CUDA graph.

`fused_moe` is the entry point; `fused_moe_reference` is its torch reference (the chosen experts' weights
gathered per token), sync-free too. Both equal MoE's dispatch → GroupedExperts.forward → combine: the
weighted sum of each token's K experts' SwiGLU outputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from seekforge.model.gpu import interpreting, triton_ready


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor,
              indices: torch.Tensor) -> torch.Tensor:
    """x (N, H); stacked experts gate_up_proj (E, 2I, H) and down_proj (E, H, I) in x's dtype; router
    weights (N, K) fp32 and indices (N, K) int → (N, H) in x's dtype: Σ_k weights[n, k] ·
    down_e(silu(gate_e(x_n)) · up_e(x_n)), e = indices[n, k]."""
    if triton_ready(x) and x.shape[0] > 0:
        return fused_moe_triton(x, gate_up_proj, down_proj, weights, indices)
    return fused_moe_reference(x, gate_up_proj, down_proj, weights, indices)


def fused_moe_reference(x, gate_up_proj, down_proj, weights, indices) -> torch.Tensor:
    gate_up = torch.einsum("nh,nkoh->nko", x.float(), gate_up_proj[indices].float())  # (N, K, 2I)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # (N, K, I)
    out = torch.einsum("nki,nkhi->nkh", act, down_proj[indices].float())  # (N, K, H)
    return (out * weights[..., None]).sum(dim=1).to(x.dtype)


class MoeBlocks(NamedTuple):
    """The kernels' tile sizes: BLOCK_M copies × BLOCK_N output columns, the reduction in BLOCK_K steps."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def moe_blocks(num_copies: int, num_experts: int, hidden: int, inter: int) -> MoeBlocks:
    """Blocks from the shapes. BLOCK_M follows the copies an expert gets on average: at decode sizes most
    chosen experts get one or a few, and a tile's rows past its expert's copies are padding that still costs
    its share of the dot (16 is tl.dot's floor). N and K blocks of 64 (bf16: 128-byte rows per load), smaller
    only where H or I is (tiny test models). vLLM's default for untuned shapes is close to this; nothing here
    was tuned on a GPU."""
    per_expert = num_copies / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    block = min(64, max(16, _next_power_of_2(min(hidden, inter))))
    return MoeBlocks(block_m, block, block)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Alignment(NamedTuple):
    """The copies sorted by expert, each expert's group padded to whole tiles (align_tokens)."""

    sorted_ids: torch.Tensor  # (P,) int32: copy index per padded row; S on padding rows (out of range)
    tile_expert: torch.Tensor  # (T,) int32: the expert of each tile; E past the real tiles
    num_tiles: torch.Tensor  # (1,) int32: the real tiles, T at most


def max_tiles(num_copies: int, num_experts: int, block_m: int) -> int:
    """T: the most tiles S copies can need. Each expert that gets copies pads at most block_m - 1 rows, and at
    most min(E, S) experts get any (at batch 1 of a 256-expert model: K experts, not E)."""
    return -(-(num_copies + min(num_experts, num_copies) * (block_m - 1)) // block_m)


def align_tokens(indices: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """indices (N, K) → the copies sorted by expert (stable: copy order within an expert), each expert's group
    padded to a multiple of block_m rows. Sync-free: counts by scatter_add (bincount reads its output size
    on the host), every shape from N, K, E and block_m, the number of real tiles left on the device."""
    flat = indices.reshape(-1).long()  # (S,)
    s, device = flat.numel(), flat.device
    tiles = max_tiles(s, num_experts, block_m)
    order = flat.argsort(stable=True)  # (S,) copy indices grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,) each expert's rows, whole tiles
    padded_end = padded.cumsum(0)  # (E,)
    expert = flat[order]  # (S,) the sorted copies' experts
    rank = torch.arange(s, device=device) - (counts.cumsum(0) - counts)[expert]  # (S,) place within its expert
    row = (padded_end - padded)[expert] + rank  # (S,) padded row of each sorted copy
    sorted_ids = torch.full((tiles * block_m,), s, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, row, order.to(torch.int32))
    tile_start = torch.arange(0, tiles * block_m, block_m, device=device)  # (T,)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)  # experts ending ≤ start
    num_tiles = (padded_end[-1:] // block_m).to(torch.int32)
    return Alignment(sorted_ids, tile_expert, num_tiles)


def fused_moe_triton(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor,
                     indices: torch.Tensor, blocks: MoeBlocks | None = None) -> torch.Tensor:
    """fused_moe by the two Triton kernels (fused_moe_kernels.py), with the blocks of `moe_blocks` unless given.
    The K copies of each token are summed in fp32 and rounded once to x's dtype."""
    from seekforge.model.gpu import fused_moe_kernels as kernels  # imports triton, an optional dependency

    (n, hidden), (num_experts, inter) = x.shape, (down_proj.shape[0], down_proj.shape[2])
    k = indices.shape[1]
    s = n * k
    assert gate_up_proj.dtype == down_proj.dtype == x.dtype, (x.dtype, gate_up_proj.dtype, down_proj.dtype)
    assert gate_up_proj.shape == (num_experts, 2 * inter, hidden), (gate_up_proj.shape, down_proj.shape)
    blocks = blocks or moe_blocks(s, num_experts, hidden, inter)
    x, weights = x.contiguous(), weights.float().contiguous()  # no-ops as MoE calls it
    aligned = align_tokens(indices, num_experts, blocks.block_m)
    tiles = aligned.tile_expert.shape[0]
    act = x.new_empty(tiles * blocks.block_m, inter)  # (P, I)
    out_copies = x.new_empty(s, hidden, dtype=torch.float32)  # (S, H)
    # fp32 weights: exact fp32 products as torch's matmuls (tf32 is off there by default); bf16 ignores it
    launch = dict(BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
                  num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    kernels.gate_up_kernel[(tiles, -(-inter // blocks.block_n))](
        x, gate_up_proj, act, *aligned, s, k, hidden, inter,
        x.stride(0), *gate_up_proj.stride(), act.stride(0), **launch)
    kernels.down_kernel[(tiles, -(-hidden // blocks.block_n))](
        act, down_proj, weights, out_copies, *aligned, s, hidden, inter,
        act.stride(0), *down_proj.stride(), out_copies.stride(0), **launch)
    return out_copies.view(n, k, hidden).sum(dim=1).to(x.dtype)
