"""Layer costs measured on this machine: the stage balancer's alternative to FLOP counts.

Each main layer (a real `Block`), and the tail (final norm, head, MTP modules and the objective, as
the last pipeline stage runs them), is timed forward and backward on one micro-batch, under the
trainer's compute dtype; the median of `repeats` runs after a warm-up. Like the traced mode, this
builds model pieces (model/ is below plan/); nothing is parallelized.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import numpy as np
import torch

from seekforge.config import ModelConfig
from seekforge.plan.balance import LayerCosts


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, thread pool, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_times(cfg: ModelConfig, micro_batch_size: int, seq_len: int, dtype: torch.dtype = torch.float32,
                  repeats: int = 3) -> tuple[np.ndarray, float]:
    """(forward + backward seconds of each main layer, of the tail) for one micro-batch."""
    from seekforge.model.loss import objective
    from seekforge.model.model import build_model

    model = build_model(cfg, seed=0)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else nullcontext()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(micro_batch_size, seq_len, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch_size, seq_len), generator=gen)
    cos, sin = model.rotary(torch.arange(seq_len))

    def layer_step(layer):
        def run():
            x = hidden.clone().requires_grad_()
            with autocast:
                out = layer(x, cos, sin)
            out.float().sum().backward()
        return run

    def tail_step():
        h = hidden.clone().requires_grad_()
        with autocast:
            loss, _ = objective(model, h, ids, ids, (cos, sin))
        loss.backward()

    layer_times = np.array([_median_seconds(layer_step(layer), repeats) for layer in model.layers])
    return layer_times, _median_seconds(tail_step, repeats)


def with_profiled_times(costs: LayerCosts, layer_times: np.ndarray, tail_time: float) -> LayerCosts:
    """`costs` (bytes from the analytic model) with measured times; recompute scales with them."""
    scale = layer_times / costs.time
    return LayerCosts(layer_times, {m: r * scale for m, r in costs.recompute.items()}, costs.activations,
                      costs.state, costs.first_time, costs.first_state, costs.first_activations, tail_time,
                      costs.last_state, costs.last_activations)
