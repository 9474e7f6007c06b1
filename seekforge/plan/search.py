"""Parallel strategy search: for a described cluster, every dp/tp/ep/pp/micro-batch/recompute/schedule
layout that fits the device memory, ranked by predicted tokens per second.

Time model (per training step, one global batch):
  compute   the step's FLOPs on one device (config/sizes.py; recompute adds the forward it reruns) at
            the cluster's achievable FLOP/s;
  pipeline  the schedule simulated with equal stages (plan/schedule.py): step = simulated time of
            m micro-batches, so the bubble is the schedule's own;
  TP        two all-reduces of the (tokens, H) activations per block forward and two in backward,
            ring cost 2(tp−1)/tp · bytes / bandwidth, not overlapped;
  EP        dispatch and combine all-to-alls of the routed copies, forward and backward,
            (ep−1)/ep · bytes / bandwidth; DualPipeV hides them behind the other micro-batch's compute
            (DeepSeek-V3 §3.2.1), the other schedules do not;
  FSDP      per micro-batch, all-gathers of the bf16 weights for forward and for backward and a
            reduce-scatter of the fp32 gradients, over the dense group (dp_shard) and the experts'
            (dp_shard / ep), overlapped with the compute: only what exceeds it counts;
  PP p2p    a latency + (tokens, H) bytes per stage boundary crossing, on the simulated critical path.
A group of ranks inside one node uses the intra-node bandwidth, one that spans nodes the inter-node one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from seekforge.config import ModelConfig, ParallelConfig
from seekforge.plan import schedule as sched
from seekforge.plan.memory import estimate_memory
from seekforge.plan.shapes import model_units, recompute_flops, unit_flops

SEARCHED_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


@dataclass
class Cluster:
    devices: int
    device_memory: float  # bytes
    flops: float = 400e12  # achievable bf16 FLOP/s per device
    devices_per_node: int = 8
    intra_node_bandwidth: float = 150e9  # bytes/s per device (NVLink)
    inter_node_bandwidth: float = 50e9  # bytes/s per device (400 Gb/s InfiniBand)
    p2p_latency: float = 20e-6  # seconds per pipeline send
    memory_reserve: float = 0.05  # share of device memory left to the allocator, CUDA context, NCCL


@dataclass
class Plan:
    parallel: ParallelConfig
    micro_batch_size: int  # sequences per pipeline micro-batch (per gradient-accumulation step at pp=1)
    step_time: float
    tokens_per_second: float
    peak_memory: float
    bubble_ratio: float
    times: dict[str, float] = field(default_factory=dict)

    def parallel_arg(self) -> str:
        pc, parts = self.parallel, []
        for key in ("dp_replicate", "dp_shard", "tp", "ep", "pp"):
            if getattr(pc, key) > 1:
                parts.append(f"{key}={getattr(pc, key)}")
        if pc.pp > 1:
            parts += [f"pp_schedule={pc.pp_schedule}", f"microbatches={pc.microbatches}"]
        if pc.recompute != "none":
            parts.append(f"recompute={pc.recompute}")
        parts.append("mixed_precision=bf16")
        return ",".join(parts)


@dataclass
class SearchResult:
    plans: list[Plan]  # fitting layouts, fastest first
    considered: int
    smallest_peak: float  # the least memory any layout needed
    smallest_layout: str  # and which layout that was
    smallest_state: float  # of which parameters, gradients and optimizer states (its peak rank)


def search(cfg: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int, top: int = 10,
           micro_batch_sizes: tuple[int, ...] = (1, 2), optimizer_bytes: int = 4) -> SearchResult:
    """Rank layouts of `cluster.devices` ranks for a step of `global_batch` sequences of `seq_len`."""
    if cluster.devices < 1 or cluster.device_memory <= 0:
        raise ValueError(f"describe a cluster with devices >= 1 and a positive device memory; got "
                         f"devices={cluster.devices}, device_memory={cluster.device_memory}")
    usable = cluster.device_memory * (1 - cluster.memory_reserve)
    plans, considered = [], 0
    smallest, smallest_layout, smallest_state = math.inf, "", 0.0
    for pc, mbs in _layouts(cfg, cluster.devices, global_batch, micro_batch_sizes, cluster.devices_per_node):
        considered += 1
        dp = pc.dp_replicate * pc.dp_shard
        per_rank_batch = global_batch // dp
        estimate = estimate_memory(cfg, pc, mbs * pc.microbatches if pc.pp > 1 else mbs, seq_len, "bf16",
                                   optimizer_bytes, flash_attention=True)
        memory = estimate.peak
        if memory < smallest:
            worst = max(estimate.ranks, key=lambda r: r.peak)
            smallest, smallest_layout = memory, _describe(pc, mbs)
            smallest_state = worst.params + worst.grads + worst.optimizer
        if memory > usable:
            continue
        step, bubble, times = _step_time(cfg, pc, cluster, mbs, per_rank_batch, seq_len)
        plans.append(Plan(pc, mbs, step, global_batch * seq_len / step, memory, bubble, times))
    plans.sort(key=lambda p: -p.tokens_per_second)
    return SearchResult(plans[:top], considered, smallest, smallest_layout, smallest_state)


def why_nothing_fits(result: SearchResult, cluster: Cluster) -> str:
    usable = cluster.device_memory * (1 - cluster.memory_reserve)
    state = result.smallest_state
    if state > usable:
        fix = "parameters, gradients and AdamW states alone do not fit: add devices (or memory per device)"
    else:
        fix = "activations are the rest: shorten the sequences, or add devices for more pipeline stages"
    return (f"no layout of {cluster.devices} devices fits: the smallest peak, {result.smallest_peak / 2**30:.1f} GiB "
            f"({result.smallest_layout}; {state / 2**30:.1f} GiB of it parameters, gradients and optimizer "
            f"states), exceeds the {usable / 2**30:.1f} GiB usable per device ({cluster.device_memory / 2**30:.1f} "
            f"GiB less {cluster.memory_reserve:.0%} reserve); {result.considered} layouts tried. {fix}.")


def _describe(pc: ParallelConfig, mbs: int) -> str:
    schedule = f" {pc.pp_schedule}" if pc.pp > 1 else ""
    return (f"dp_shard={pc.dp_shard}, tp={pc.tp}, ep={pc.ep}, pp={pc.pp}{schedule}, micro-batch {mbs}, "
            f"recompute={pc.recompute}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(cfg: ModelConfig, devices: int, global_batch: int, micro_batch_sizes, devices_per_node: int):
    """Every ParallelConfig the model and cluster allow: tp inside a node, FSDP over the data-parallel
    ranks, ep dividing dp_shard; whatever else pretrain refuses (ParallelConfig's checks: tp dividing the
    heads and widths, ep the experts, a layer per stage, enough micro-batches) is skipped."""
    for tp in _divisors(min(devices, devices_per_node)):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            eps = [e for e in _divisors(dp) if cfg.n_routed_experts and cfg.n_routed_experts % e == 0] or [1]
            for ep in eps:
                for mbs in micro_batch_sizes:
                    if per_rank % mbs:
                        continue
                    microbatches = per_rank // mbs
                    schedules = SEARCHED_SCHEDULES if pp > 1 else ("1F1B",)
                    for schedule in schedules:
                        for recompute in ("none", "selective", "full"):
                            try:
                                pc = ParallelConfig(dp_shard=dp, tp=tp, ep=ep, pp=pp, pp_schedule=schedule,
                                                    microbatches=microbatches if pp > 1 else 1,
                                                    recompute=recompute, mixed_precision="bf16")
                                pc.validate(devices, cfg)
                            except ValueError:
                                continue
                            yield pc, mbs


def _unit_step(schedule: str, pp: int, microbatches: int) -> tuple[float, float]:
    """(simulated step, bubble ratio) for stages of F = B = W = 1 (a stage does 3 units per micro-batch)."""
    result = sched.simulate_uniform(schedule, pp, microbatches)
    return result.step_time, result.bubble_ratio


def _bandwidth(cluster: Cluster, group_span: int) -> float:
    """A group of `group_span` consecutive ranks stays in a node when it fits one."""
    return cluster.intra_node_bandwidth if group_span <= cluster.devices_per_node else cluster.inter_node_bandwidth


def _step_time(cfg: ModelConfig, pc: ParallelConfig, cluster: Cluster, mbs: int, per_rank_batch: int,
               seq_len: int) -> tuple[float, float, dict[str, float]]:
    tokens_mb = mbs * seq_len
    units = model_units(cfg)
    fwd = bwd = recompute = 0.0
    for u in units:
        f, b = unit_flops(cfg, u, tokens_mb, seq_len)
        fwd, bwd = fwd + f, bwd + b
        recompute += recompute_flops(cfg, u, tokens_mb, seq_len, pc.recompute)
    per_device = pc.tp * pc.pp  # the micro-batch's work is spread over a tp × pp slice
    compute_mb = (fwd + bwd + recompute) / per_device / cluster.flops  # one micro-batch, one stage-rank
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    act_bytes = 2.0 * tokens_mb * cfg.hidden_size
    tp_comm = 0.0
    if pc.tp > 1:
        tp_comm = 4 * blocks / pc.pp * 2 * (pc.tp - 1) / pc.tp * act_bytes / _bandwidth(cluster, pc.tp)
    ep_comm = 0.0
    if pc.ep > 1:
        copies = 2.0 * tokens_mb * cfg.num_experts_per_tok * cfg.hidden_size
        ep_comm = 4 * cfg.num_moe_layers / pc.pp * (pc.ep - 1) / pc.ep * copies / _bandwidth(cluster, pc.ep * pc.tp)
        if pc.pp_schedule == "DualPipeV" and pc.pp > 1:
            ep_comm = max(0.0, ep_comm - compute_mb)
    stage_mb = compute_mb + tp_comm + ep_comm  # one micro-batch through one pp rank
    microbatches = pc.microbatches if pc.pp > 1 else per_rank_batch // mbs
    if pc.pp > 1:
        unit_step, bubble = _unit_step(pc.pp_schedule, pc.pp, microbatches)
        # the unit simulation runs a rank's stages at 3 units per micro-batch each
        pipeline = unit_step / (3 * pc.stages_per_rank) * stage_mb
        pipeline += 2 * (pc.num_stages - 1) * (cluster.p2p_latency + act_bytes / pc.tp / cluster.inter_node_bandwidth)
    else:
        bubble, pipeline = 0.0, microbatches * stage_mb
    # FSDP gathers each block's bf16 weights for its forward and again for its backward, and
    # reduce-scatters its fp32 gradients, every micro-batch (reshard after forward): 2 + 2 + 4 bytes
    # per parameter over its group, (g−1)/g of them. Experts shard over dp_shard / ep ranks only.
    dense = sum(u.attn_params + u.dense_params for u in units) / (pc.tp * pc.pp)
    experts = sum(u.expert_params for u in units) / (pc.ep * pc.pp)
    dp_comm = 0.0
    for params, group in ((dense, pc.dp_shard), (experts, pc.dp_shard // pc.ep)):
        if group > 1:
            span = group * pc.tp * (pc.ep if params is experts else 1)
            dp_comm += microbatches * params * 8 * (group - 1) / group / _bandwidth(cluster, span)
    exposed_dp = max(0.0, dp_comm - pipeline)  # overlapped with the compute it feeds
    step = pipeline + exposed_dp
    return step, bubble, {"compute": microbatches * compute_mb, "tp": microbatches * tp_comm,
                          "ep": microbatches * ep_comm, "dp exposed": exposed_dp}
