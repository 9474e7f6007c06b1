"""fused_moe.py's two Triton kernels (imported only where Triton runs: Triton is an optional dependency).

Shape legend as fused_moe.py: S copies, P padded rows (T tiles of BLOCK_M), H hidden, I intermediate, E experts.
Both grids are (T, output columns / BLOCK_N); a tile's rows are copies of one expert (align_tokens), its padding
rows hold the sentinel S. A program whose tile is past the real ones (`num_tiles`, on the device) returns at
once: the grid is sized for the worst routing, the work is the routing's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_rows(tile, sorted_ids_ptr, tile_expert_ptr, num_copies, BLOCK_M: tl.constexpr):
    """A real tile's padded rows (BM,), the copy in each (the sentinel S on padding), which are real, and its
    expert (int64: E·2I·H overflows int32 at DeepSeek-V3's sizes)."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    copy = tl.load(sorted_ids_ptr + rows)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    return rows, copy, copy < num_copies, expert


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ids_ptr, tile_expert_ptr, num_tiles_ptr,
                   num_copies, top_k, hidden, inter,
                   stride_x, stride_we, stride_wo, stride_wh, stride_act,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """act[p, i] = silu(x_t · gate_e[i]) · (x_t · up_e[i]) for the padded row p of copy c = sorted_ids[p],
    token t = c // K, e its tile's expert; x (N, H), gate_up (E, 2I, H) (gate rows, then up rows), act (P, I).
    Padding rows get zeros (their x rows load as zeros)."""
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):
        return
    rows, copy, real, expert = _tile_rows(tile, sorted_ids_ptr, tile_expert_ptr, num_copies, BLOCK_M)
    token = (copy // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) intermediate columns
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]  # (BM, BK)
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wo + ks[:, None] * stride_wh  # (BK, BN)
    up_ptrs = gate_ptrs + inter * stride_wo
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if UPCAST:  # the interpreter computes on bf16 as integers (gpu/__init__.py)
            a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wh
        up_ptrs += BLOCK_K * stride_wh
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # silu(gate) · up in fp32, rounded once
    act_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def down_kernel(act_ptr, w_ptr, weights_ptr, out_ptr, sorted_ids_ptr, tile_expert_ptr, num_tiles_ptr,
                num_copies, hidden, inter,
                stride_act, stride_we, stride_wh, stride_wi, stride_out,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[c, h] = weights[c] · (act[p] · down_e[h]) for the padded row p of each real copy c = sorted_ids[p],
    written to the copy's own row (each written once: no atomics, the same sums every run); act (P, I),
    down (E, H, I), router weights (N·K,) fp32, out (S, H) fp32."""
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):
        return
    rows, copy, real, expert = _tile_rows(tile, sorted_ids_ptr, tile_expert_ptr, num_copies, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) hidden columns
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + ks[None, :]  # (BM, BK)
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wh + ks[:, None] * stride_wi  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wi
    weight = tl.load(weights_ptr + copy, mask=real, other=0.0)  # (BM,) copy n·K + k is weights[n, k]
    out_ptrs = out_ptr + copy.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc * weight[:, None], mask=real[:, None] & col_ok[None, :])
