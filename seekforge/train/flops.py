"""Model FLOPs per token and a measured matmul peak, for MFU (PaLM appendix B convention).

Training FLOPs per token = 6 · (activated matmul parameters) + attention, where the attention term
per layer is 6 · T · nh · (qk_head_dim + v_head_dim): QKᵀ and PV, forward (2 FLOPs per MAC) plus
backward (twice that). Causality is not discounted (as in torchtitan and PaLM), and recompute is not
counted: MFU measures useful model work, not the hardware's total.
"""

from __future__ import annotations

import time

import torch

from seekforge.config import ModelConfig


def activated_matmul_params(cfg: ModelConfig) -> int:
    """Parameters one token multiplies through: main model + MTP modules, routed experts counted
    K of E, the embedding table excluded (a lookup), the output head counted once per head call."""
    counts = cfg.num_params()
    h, v = cfg.hidden_size, cfg.vocab_size
    main = counts["active"] - v * h  # drop the embedding lookup; keeps lm_head
    mtp_total = counts["mtp"]
    if cfg.n_routed_experts and cfg.num_nextn_predict_layers:
        inactive = (cfg.n_routed_experts - cfg.num_experts_per_tok) * 3 * h * cfg.moe_intermediate_size
        mtp_total -= cfg.num_nextn_predict_layers * inactive
    mtp_head_calls = cfg.num_nextn_predict_layers * v * h  # each MTP depth runs the shared head
    return main + mtp_total + mtp_head_calls


def flops_per_token(cfg: ModelConfig, seq_len: int, with_mtp: bool = True) -> float:
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    params = activated_matmul_params(cfg) if with_mtp else cfg.num_params()["active"] - cfg.vocab_size * cfg.hidden_size
    attention = 6 * layers * seq_len * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return 6 * params + attention


def measure_peak_flops(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                       size: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of a square matmul in `dtype`: the achievable peak of this machine, right now.
    On shared CPUs it moves with the load; pass TrainConfig.peak_flops to fix it."""
    # A private generator: probing must not shift the global RNG stream that training (and its exact
    # resume) depends on.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device).to(dtype)
    for _ in range(2):  # warm up caches and the BLAS thread pool
        a @ b
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
        if iters % 4 == 0:
            sync()
    sync()
    return 2 * size**3 * iters / (time.perf_counter() - start)


def model_flops_utilization(flops_per_s: float, peak_flops: float) -> float:
    """Achieved / peak, at most 1: a rate above the probe's peak means the probe ran slow (a loaded
    machine, a cold thread pool), and the true peak is at least what was achieved."""
    return flops_per_s / max(peak_flops, flops_per_s)
