"""seekforge's CPU kernels (model/kernels.py) against the PyTorch calls they replace, on the serving benchmarks'
model (the `small` preset with kv_lora_rank 512 and qk_rope_head_dim 64, as serve_peers.py runs it).

- one-row linear layers: `kernels.linear` vs F.linear, for each distinct weight shape of the model (attention
  projections, dense and shared MLPs, one expert, the LM head), each call on another copy of the weight, so the
  weight streams from memory as a decode step's do (the copies together are larger than the last-level cache);
- MLA's absorbed per-head products at one decode row: `kernels.bmm` / `kernels.bmm_t` vs torch.bmm on the views
  MLA.kv_b_weights makes, each call on another copy of kv_b_proj's weight (from memory, as for the linears);
- decode attention over latents: 64 sequences × 192 latents, one layer, vs PyTorch's fused attention as MLA runs
  it without the kernel.

Prints the machine, the dtype, and what a plain sum streams (the machine's read bandwidth), then per call both
times, the bytes of weight each read per second, and the ratio. On CPUs that do not run the kernels (AVX2, or
AMX: see kernels.py) it says so and stops.

    PYTHONPATH=. python benchmarks/cpu_kernels.py [--dtype auto|bf16|fp32] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from machine import machine_header, parse_args  # benchmarks/machine.py

from seekforge.config import preset
from seekforge.model import kernels
from seekforge.model.model import build_model

MODEL_OVERRIDES = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_nextn_predict_layers=0)  # serve_peers.py's
STREAM_BYTES = 256 << 20  # the copies of each weight together: past any last-level cache


def best_us(fn, inputs: list[tuple], repeats: int = 5) -> float:
    """Best over `repeats` of the mean time of fn(*args) over `inputs`, in µs."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for args in inputs:
            fn(*args)
        best = min(best, (time.perf_counter() - start) / len(inputs))
    return best * 1e6


def row(name: str, nbytes: int, ours, theirs, inputs: list[tuple]) -> None:
    """One table row: PyTorch's call and ours on the same inputs, timed in turn."""
    theirs_us, ours_us = best_us(theirs, inputs), best_us(ours, inputs)
    print(f"| {name} | {theirs_us:8.1f} | {nbytes / theirs_us / 1e3:5.1f} | {ours_us:8.1f} | "
          f"{nbytes / ours_us / 1e3:5.1f} | {theirs_us / ours_us:5.2f}× |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = parse_args(p, threads=2)
    cfg = preset("small", **MODEL_OVERRIDES)
    dtype, _ = machine_header(args.dtype, probe_peak=False, hidden_size=cfg.hidden_size)
    if not kernels.load():
        print("this CPU does not run seekforge's kernels (they need AVX-512 without AMX, and a C++ toolchain)")
        return
    big = torch.ones(STREAM_BYTES // 4)
    sum_us = best_us(torch.sum, [(big,)], repeats=3)
    print(f"read bandwidth (torch.sum over {STREAM_BYTES >> 20} MiB fp32): {big.nbytes / sum_us / 1e3:.1f} GB/s")
    model = build_model(cfg, seed=0).eval().to(dtype)
    gen = torch.Generator().manual_seed(0)
    print("\n| call | PyTorch µs | GB/s | seekforge µs | GB/s | speed-up |\n|---|---|---|---|---|---|")
    with torch.no_grad():
        shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        experts = next(m.mlp.experts for m in model.layers if hasattr(m.mlp, "experts"))
        shapes |= {tuple(experts.gate_up_proj.shape[1:]), tuple(experts.down_proj.shape[1:])}
        for n, k in sorted(shapes):
            copies = max(4, STREAM_BYTES // (n * k * dtype.itemsize))
            weights = torch.randn(copies, n, k, generator=gen).to(dtype)
            x = torch.randn(1, k, generator=gen).to(dtype)
            row(f"linear 1 × {k} → {n}", weights[0].nbytes, kernels.linear, F.linear, [(x, w) for w in weights])
        attn = model.layers[0].self_attn
        nh, dn, r = attn.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        kv_b = attn.kv_b_proj.weight  # copies of it, split per head as MLA does (views with a gap between heads)
        copies = torch.randn(max(4, STREAM_BYTES // kv_b.nbytes), *kv_b.shape, generator=gen).to(dtype)
        per_copy = [attn.kv_b_weights(w) for w in copies]
        q, latent = torch.randn(nh, 1, dn, generator=gen).to(dtype), torch.randn(nh, 1, r, generator=gen).to(dtype)
        row(f"absorbed keys {nh} × (1 × {dn} → {r})", per_copy[0][0].numel() * dtype.itemsize, kernels.bmm,
            torch.bmm, [(q, w_uk) for w_uk, _ in per_copy])
        row(f"absorbed values {nh} × (1 × {r} → {cfg.v_head_dim})", per_copy[0][1].numel() * dtype.itemsize,
            kernels.bmm_t, lambda x, w: torch.bmm(x, w.transpose(1, 2)), [(latent, w_uv) for _, w_uv in per_copy])
        seqs, length, width = 64, 192, r + cfg.qk_rope_head_dim
        latents = torch.randn(seqs, length, width, generator=gen).to(dtype)
        queries = torch.randn(seqs, nh, width, generator=gen).to(dtype)
        scale = attn.softmax_scale
        row(f"decode attention {seqs} × ({nh} × {length} latents × {width})", latents.nbytes,
            lambda q, lat: torch.ops.seekforge.latent_attention(q, lat, None, scale, r),
            lambda q, lat: F.scaled_dot_product_attention(q[:, None], lat[:, None], lat[:, None], scale=scale),
            [(queries, latents)] * 4)
    print("\nGB/s: bytes of weight (latents, for attention) read per second; speed-up: PyTorch's time / seekforge's")


if __name__ == "__main__":
    main()
