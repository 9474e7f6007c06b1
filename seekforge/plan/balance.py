"""SAPP-style pipeline stage balancer: how many layers each stage holds and how much each stage
recomputes, so that the pipeline's step time is smallest while every stage fits its memory.

The layers are heterogeneous (dense first-k, MoE, the embedding on the first stage, the head and the
MTP modules on the last); a stage is a contiguous run of main layers plus those fixed parts, and
takes one recompute mode for all its blocks. The step time model is 1F1B's (Narayanan et al. 2021):
    step = Σ_s t_s + (m − 1) · max_s t_s,      t_s = F_s + B_s + W_s + recompute_s,
the fill-and-drain once through every stage plus m − 1 micro-batches at the slowest one. A stage's
memory is its parameter state plus its in-flight micro-batches' activations (plan/memory.py's
per-unit bytes, in-flight counts from plan/schedule.py).

Exact search: for a cap C on the slowest stage, a DP over (stage, first layer) gives the smallest
Σ t_s with every t_s ≤ C and every stage within memory; the optimum is min over caps C of
(m − 1)·C + that sum, and caps are tried in increasing order until (m − 1)·C alone exceeds the best
found. tests/plan/test_balance.py checks it against brute force.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seekforge.config import ModelConfig, ParallelConfig
from seekforge.plan import memory as mem
from seekforge.plan import schedule as sched
from seekforge.plan.shapes import model_units, recompute_flops, unit_flops

MODES = ("none", "selective", "full")


@dataclass
class LayerCosts:
    """Seconds and bytes per main layer and per fixed part, for one micro-batch.

    time[i]: F + B + W of layer i; recompute[mode][i]: extra forward time of that mode;
    activations[mode][i]: bytes one in-flight micro-batch keeps; state[i]: parameter, gradient and
    optimizer bytes. first_* / last_*: the embedding (first stage) and head + MTP (last stage)."""

    time: np.ndarray
    recompute: dict[str, np.ndarray]
    activations: dict[str, np.ndarray]
    state: np.ndarray
    first_time: float
    first_state: float
    first_activations: float
    last_time: float
    last_state: float
    last_activations: dict[str, float]  # the MTP blocks take the last stage's mode too


@dataclass
class Balance:
    split_points: list[int]  # first layer of stages 1..n-1 (ParallelConfig.pp_split_points)
    recompute: list[str]  # per stage
    stage_times: list[float]
    stage_memory: list[float]
    step_time: float  # the 1F1B model's

    def layer_modes(self, cfg: ModelConfig) -> list[str]:
        """One recompute mode per block (main layers, then MTP blocks), as ParallelConfig.recompute."""
        bounds = [0, *self.split_points, cfg.num_hidden_layers]
        modes = [self.recompute[s] for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
        return modes + [self.recompute[-1]] * cfg.num_nextn_predict_layers

    def parallel_arg(self, cfg: ModelConfig, pc: ParallelConfig) -> str:
        """A ready `--parallel` value."""
        modes = set(self.recompute)
        recompute = modes.pop() if len(modes) == 1 else "[" + ",".join(self.layer_modes(cfg)) + "]"
        parts = [f"pp={pc.pp}", f"pp_schedule={pc.pp_schedule}", f"microbatches={pc.microbatches}",
                 "pp_split_points=[" + ",".join(map(str, self.split_points)) + "]", f"recompute={recompute}"]
        if pc.mixed_precision != "fp32":  # the precision the stage memory was counted in
            parts.append(f"mixed_precision={pc.mixed_precision}")
        for key in ("dp_replicate", "dp_shard", "tp", "ep"):
            if getattr(pc, key) > 1:
                parts.insert(0, f"{key}={getattr(pc, key)}")
        return ",".join(parts)


def analytic_costs(cfg: ModelConfig, pc: ParallelConfig, micro_batch_size: int, seq_len: int,
                   flops_per_second: float, dtype: str = "bf16", optimizer_bytes: int = 4,
                   flash_attention: bool = True) -> LayerCosts:
    """Layer costs from FLOPs (config/sizes.py) at `flops_per_second` per device and bytes from
    plan/memory.py's per-unit model; micro_batch_size is one pipeline micro-batch."""
    shape = mem.UnitBytes(cfg, pc, micro_batch_size, seq_len, 2 if dtype == "bf16" else 4, 1.0, flash_attention)
    tokens = micro_batch_size * seq_len
    per_device = pc.tp * pc.cp  # tensor parallel splits every matmul, context parallel every row

    def seconds(unit):
        fwd, bwd = unit_flops(cfg, unit, tokens, seq_len)
        return fwd / (flops_per_second * per_device), bwd / (flops_per_second * per_device)

    def state_bytes(m):
        return m.params * (2 + 2 * optimizer_bytes / 4)  # params + grads + two moments

    units = model_units(cfg)
    layers = [u for u in units if u.kind in ("dense", "moe")]
    tail = [u for u in units if u.kind in ("head", "mtp")]
    time, state = [], []
    recompute = {m: [] for m in MODES}
    activations = {m: [] for m in MODES}
    for u in layers:
        fwd, bwd = seconds(u)
        time.append(fwd + bwd)
        for m in MODES:
            um = shape.unit(u, m)
            activations[m].append(um.activations + um.copies)
            recompute[m].append(recompute_flops(cfg, u, tokens, seq_len, m) / (flops_per_second * per_device))
        state.append(state_bytes(shape.unit(u, "none")))
    embed = shape.unit(units[0], "none")
    tail_mem = {m: [shape.unit(u, m) for u in tail] for m in MODES}
    last_time = sum(sum(seconds(u)) for u in tail)
    last_state = sum(state_bytes(x) for x in tail_mem["none"])
    if cfg.num_nextn_predict_layers and pc.stages_per_rank == 1:
        last_state += state_bytes(embed)  # the MTP copy of the embedding
    return LayerCosts(np.array(time), {m: np.array(v) for m, v in recompute.items()},
                      {m: np.array(v) for m, v in activations.items()}, np.array(state), 0.0,
                      state_bytes(embed), embed.activations, last_time, last_state,
                      {m: sum(x.activations + x.copies for x in tail_mem[m]) for m in MODES})


def inflight_per_stage(pc: ParallelConfig) -> list[int]:
    """Micro-batches each stage holds at its peak under pc's schedule (equal stage costs)."""
    name = pc.pp_schedule if pc.pp_schedule in sched.SIMULATED_SCHEDULES else "1F1B"
    return list(sched.simulate_uniform(name, pc.pp, pc.microbatches).peak_inflight)


def _stage_tables(costs: LayerCosts, num_stages: int, inflight: list[int]):
    """time[mode][a, b] and memory[s][mode][a, b] of a stage holding layers [a, b)."""
    n = len(costs.time)
    prefix = np.concatenate([[0.0], np.cumsum(costs.time)])
    seg = prefix[None, :] - prefix[:, None]  # (n+1, n+1): layers [a, b) time
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    times, mems = {}, [{} for _ in range(num_stages)]
    state_prefix = np.concatenate([[0.0], np.cumsum(costs.state)])
    state = state_prefix[None, :] - state_prefix[:, None]
    for m in MODES:
        rp = np.concatenate([[0.0], np.cumsum(costs.recompute[m])])
        ap = np.concatenate([[0.0], np.cumsum(costs.activations[m])])
        times[m] = np.where(valid, seg + rp[None, :] - rp[:, None], np.inf)
        acts = ap[None, :] - ap[:, None]
        for s in range(num_stages):
            fixed_state = (costs.first_state if s == 0 else 0.0) + (costs.last_state if s == num_stages - 1 else 0.0)
            fixed_acts = (costs.first_activations if s == 0 else 0.0) + \
                (costs.last_activations[m] if s == num_stages - 1 else 0.0)
            mems[s][m] = np.where(valid, state + fixed_state + inflight[s] * (acts + fixed_acts), np.inf)
    return times, mems


def balance_stages(costs: LayerCosts, num_stages: int, microbatches: int, memory_limit: float,
                   inflight: list[int] | None = None, modes: tuple[str, ...] = MODES) -> Balance:
    """The split and per-stage recompute minimizing the 1F1B step model under `memory_limit` bytes
    per stage. Raises ValueError when no split fits."""
    n = len(costs.time)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages need at least as many layers; the model has {n}")
    inflight = inflight or [min(microbatches, num_stages - s) for s in range(num_stages)]
    times, mems = _stage_tables(costs, num_stages, inflight)
    fixed = [(costs.first_time if s == 0 else 0.0) + (costs.last_time if s == num_stages - 1 else 0.0)
             for s in range(num_stages)]
    # stage_time[s][mode]: (n+1, n+1), inf where the stage does not fit
    stage_time = [{m: np.where(mems[s][m] <= memory_limit, times[m] + fixed[s], np.inf) for m in modes}
                  for s in range(num_stages)]
    # Candidate caps: every time some stage can take (the optimum's slowest stage is one of them).
    caps = np.unique(np.concatenate([stage_time[s][m][np.isfinite(stage_time[s][m])]
                                     for s in range(num_stages) for m in modes]))
    if caps.size == 0:
        raise ValueError(f"no stage fits in {memory_limit / 2**30:.1f} GiB even with full recompute; "
                         "add pipeline stages, shard more (dp_shard/tp/ep) or lower the micro-batch size")
    lower_sum = float(np.sum(costs.time)) + sum(fixed)
    best, best_path = np.inf, None
    for cap in caps:
        if (microbatches - 1) * cap + lower_sum >= best:
            break  # no later (larger) cap can win
        total, path = _min_sum(stage_time, modes, cap, n, num_stages)
        if np.isfinite(total) and total + (microbatches - 1) * cap < best - 1e-15:
            best, best_path = total + (microbatches - 1) * cap, path
    if best_path is None:
        raise ValueError(f"no split of {n} layers into {num_stages} stages fits in {memory_limit / 2**30:.1f} "
                         "GiB per stage; add stages, shard more or lower the micro-batch size")
    bounds = [a for a, _, _ in best_path] + [n]
    stage_times = [float(stage_time[s][m][a, b]) for s, (a, b, m) in enumerate(best_path)]
    stage_memory = [float(mems[s][m][a, b]) for s, (a, b, m) in enumerate(best_path)]
    return Balance(bounds[1:-1], [m for _, _, m in best_path], stage_times, stage_memory,
                   sum(stage_times) + (microbatches - 1) * max(stage_times))


def _min_sum(stage_time, modes, cap: float, n: int, num_stages: int):
    """DP: the smallest Σ t_s with every t_s <= cap over layers [0, n) in num_stages stages."""
    f = np.full(n + 1, np.inf)
    f[0] = 0.0
    choices = []
    for s in range(num_stages):
        options = np.stack([np.where(stage_time[s][m] <= cap, stage_time[s][m], np.inf) for m in modes])
        total = f[None, :, None] + options  # (mode, a, b)
        flat = total.reshape(len(modes) * (n + 1), n + 1)
        arg = flat.argmin(axis=0)
        f = flat[arg, np.arange(n + 1)]
        choices.append(arg)
    if not np.isfinite(f[n]):
        return np.inf, None
    path, b = [], n
    for s in reversed(range(num_stages)):
        mode_index, a = divmod(int(choices[s][b]), n + 1)
        path.append((a, b, modes[mode_index]))
        b = a
    return float(f[n]), path[::-1]


def even_split(costs: LayerCosts, num_stages: int, microbatches: int, mode: str,
               inflight: list[int] | None = None) -> Balance:
    """parallel/pp.py's default split (round(i·L/n)) with one mode everywhere, in the same model."""
    n = len(costs.time)
    inflight = inflight or [min(microbatches, num_stages - s) for s in range(num_stages)]
    times, mems = _stage_tables(costs, num_stages, inflight)
    bounds = [round(i * n / num_stages) for i in range(num_stages + 1)]
    stage_times, stage_memory = [], []
    for s in range(num_stages):
        a, b = bounds[s], bounds[s + 1]
        fixed = (costs.first_time if s == 0 else 0.0) + (costs.last_time if s == num_stages - 1 else 0.0)
        stage_times.append(float(times[mode][a, b]) + fixed)
        stage_memory.append(float(mems[s][mode][a, b]))
    return Balance(bounds[1:-1], [mode] * num_stages, stage_times, stage_memory,
                   sum(stage_times) + (microbatches - 1) * max(stage_times))


def simulated_step(costs: LayerCosts, balance: Balance, schedule: str, pp: int, microbatches: int) -> float:
    """The event simulator's step time for a balance (F : B : W = 1 : 1 : 1 within a stage's time)."""
    stage_costs = []
    for t, m, (a, b) in zip(balance.stage_times, balance.recompute, _ranges(balance, len(costs.time)),
                            strict=True):
        extra = float(np.sum(costs.recompute[m][a:b]))
        work = (t - extra) / 3
        stage_costs.append(sched.StageCost(work, work, work, extra))
    return sched.simulate(schedule, stage_costs, microbatches).step_time


def _ranges(balance: Balance, n: int) -> list[tuple[int, int]]:
    bounds = [0, *balance.split_points, n]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
