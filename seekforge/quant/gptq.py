"""GPTQ (Frantar et al. 2022, arXiv:2210.17323): quantize a weight column by column, pushing each
column's rounding error onto the columns not yet quantized through the inverse Hessian of the
layer's inputs. Pure functions; calibrate.py gathers the Hessians.

Shape legend: O out_features, I in_features, G groups, n calibration rows.

The algorithm is llm-compressor's / GPTQModel's: dampening λ = frac · mean(diag H) added to H's
diagonal, the upper Cholesky factor of H⁻¹, lazy block updates of `block_size` columns. Group
scales are computed when the quantizer reaches a group's first column, from the weights as already
updated by earlier errors. With act-order the columns go by descending diag(H) and group scales are
fixed up front from the original weights (llm-compressor's "weight" act-order), so the checkpoint
needs no g_idx and the column order is undone before returning.
"""

from __future__ import annotations

import torch

from seekforge.quant.schemes import QuantArgs, dequantize_weight, qparams, weight_qparams


def accumulate_hessian(hessian: torch.Tensor, num_rows: int, x: torch.Tensor) -> int:
    """Add the rows of x (n, I) to the running H = (2 / rows) · Σ x xᵀ (I, I) in place; returns the new count."""
    n = x.shape[0]
    if n == 0:
        return num_rows
    total = num_rows + n
    hessian.mul_(num_rows / total)
    x = x.float() * (2.0 / total) ** 0.5
    hessian.addmm_(x.t(), x)
    return total


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, args: QuantArgs, dampening_frac: float = 0.01,
                  actorder: bool = False, block_size: int = 128):
    """weight (O, I), hessian (I, I) → q (O, I) int8, scale (O, G) fp32, zero_point (O, G) int8."""
    w = weight.float().clone()
    h = hessian.float().clone()
    out_features, in_features = w.shape
    group = args.group_size if args.strategy == "group" else in_features
    dead = torch.diag(h) == 0  # inputs that were always zero: any value is exact
    h[dead, dead] = 1
    w[:, dead] = 0
    fixed_groups = args.strategy != "group" or actorder
    if fixed_groups:  # per channel: one scale per row from the whole row; act-order: every group up front
        scale, zero_point = weight_qparams(w, args)
    else:
        scale = torch.zeros(out_features, in_features // group)
        zero_point = torch.zeros(out_features, in_features // group, dtype=torch.int8)
    perm = torch.argsort(torch.diag(h), descending=True) if actorder else torch.arange(in_features)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = inverse_hessian_factor(h, dampening_frac)
    q = torch.zeros(out_features, in_features, dtype=torch.int8)
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        w1 = w[:, i1:i2].clone()  # (O, b)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = int(perm[i1 + i])
            g = column // group
            if not fixed_groups and column % group == 0:
                # this group's columns, updated by every error so far (in-block ones live in w1)
                cols = w1[:, i:i + group] if i + group <= i2 - i1 else w[:, i1 + i:i1 + i + group]
                scale[:, g], zero_point[:, g] = qparams(cols.amin(dim=1), cols.amax(dim=1), args)
            wc = w1[:, i]
            qc = (wc / scale[:, g] + zero_point[:, g].float()).round().clamp(args.qmin, args.qmax)
            dq = (qc - zero_point[:, g].float()) * scale[:, g]
            q[:, i1 + i] = qc.to(torch.int8)
            err = (wc - dq) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    q = q[:, torch.argsort(perm)]
    return q, scale, zero_point


def inverse_hessian_factor(h: torch.Tensor, dampening_frac: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹. λ grows ×10 (up to 3 times) if H + λI is not positive
    definite, as GPTQModel does for nearly rank-deficient inputs."""
    diag = torch.arange(h.shape[0])
    frac = dampening_frac
    for _ in range(4):
        damped = h.clone()
        damped[diag, diag] += frac * torch.mean(torch.diag(h))
        factor, info = torch.linalg.cholesky_ex(damped)
        if info == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)
        frac *= 10
    raise ValueError(f"GPTQ: the Hessian is not positive definite even with dampening_frac={frac / 10}; "
                     "raise dampening_frac in the recipe or calibrate on more samples")


def reconstruction_error(weight: torch.Tensor, q, scale, zero_point, hessian: torch.Tensor, args: QuantArgs) -> float:
    """tr(ΔW H ΔWᵀ): the layer-output error GPTQ minimizes (tests compare it with RTN's)."""
    delta = weight.float() - dequantize_weight(q, scale, zero_point if not args.symmetric else None, args)
    return float(torch.einsum("oi,ij,oj->", delta, hessian.float(), delta))
