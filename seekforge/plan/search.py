"""Parallel strategy search: for a described cluster, every dp/tp/cp/ep/etp/ep_nodes/pp/micro-batch/
recompute/schedule layout that fits the device memory, ranked by predicted tokens per second.

Time model (per training step, one global batch):
  compute   the step's FLOPs on one device (config/sizes.py; recompute adds the forward it reruns) at
            the cluster's achievable FLOP/s;
  pipeline  the schedule simulated with equal stages (plan/schedule.py): step = simulated time of
            m micro-batches, so the bubble is the schedule's own;
  TP        two all-reduces of the (tokens, H) activations per block forward and two in backward,
            ring cost 2(tp−1)/tp · bytes / bandwidth, not overlapped;
  EP        dispatch and combine all-to-alls of the routed copies, forward and backward,
            (ep−1)/ep · bytes / bandwidth; DualPipeV hides them behind the other micro-batch's compute
            (DeepSeek-V3 §3.2.1), the other schedules do not. Hierarchical (ep_nodes > 1): one row
            per (token, destination node) crosses nodes, (G−1)/G of a token's expected nodes (at most
            the routing's node limit) at the inter-node bandwidth, then the copies (r−1)/r within
            the node of r = ep/G ranks at the intra-node one;
  expert-TP an all-gather of the received copies over the etp ranks before the experts and a
            reduce-scatter of their partial outputs after, (etp−1) × the copies each, both ways; and
            between the GEMMs the exchange of gate/up pieces (each rank stores a contiguous 1/etp of
            the fused [gate; up] rows but computes one slice of both): (etp−1)/etp of the etp ranks'
            rows × 2I/etp, forward and its gradient backward;
  CP        each rank computes T/cp of every row (the FLOPs divide by cp); per block, ring attention
            passes the MLA latents (r + dr per token, not the expanded heads) round the cp ranks:
            cp − 1 blocks forward, each in flight while the rank computes on the one it holds, and in
            backward the blocks again with their fp32 latent gradients (the last gradient's hop home
            waited on); only what a ring step's attention compute cannot hide counts; the gradients
            reduce over dp_shard × cp under FSDP, else an all-reduce over cp after backward;
  FSDP      per micro-batch, all-gathers of the bf16 weights for forward and for backward and a
            reduce-scatter of the fp32 gradients, over the dense group (dp_shard) and the experts'
            (dp_shard · cp / ep), overlapped with the compute: only what exceeds it counts;
  PP p2p    a latency + (tokens, H) bytes per stage boundary crossing, on the simulated critical path.
A group of ranks inside one node uses the intra-node bandwidth, one that spans nodes the inter-node one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from seekforge.config import ModelConfig, ParallelConfig
from seekforge.plan import schedule as sched
from seekforge.plan.memory import estimate_memory, expected_nodes_per_token
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
        for key in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "ep_nodes", "etp", "pp"):
            if getattr(pc, key) > 1:
                parts.append(f"{key}={getattr(pc, key)}")
        if pc.pp > 1:
            parts += [f"pp_schedule={pc.pp_schedule}", f"microbatches={pc.microbatches}"]
        if pc.recompute != "none":
            parts.append(f"recompute={pc.recompute}")
        parts.append(f"mixed_precision={pc.mixed_precision}")
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
    for pc, mbs in _layouts(cfg, cluster.devices, global_batch, seq_len, micro_batch_sizes, cluster.devices_per_node):
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
    return (f"dp_shard={pc.dp_shard}, cp={pc.cp}, tp={pc.tp}, ep={pc.ep}, etp={pc.etp}, ep_nodes={pc.ep_nodes}, "
            f"pp={pc.pp}{schedule}, micro-batch {mbs}, recompute={pc.recompute}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(cfg: ModelConfig, devices: int, global_batch: int, seq_len: int, micro_batch_sizes,
             devices_per_node: int):
    """Every ParallelConfig the model and cluster allow, with FSDP's bf16 policy: tp inside a node, cp ranks
    sharing a data-parallel rank's rows (seq_len a multiple of 2·cp), FSDP over the data-parallel (× cp)
    ranks, ep dividing dp_shard (× cp: ep may borrow cp ranks), etp splitting the experts of ep > 1 over
    more of them, and, where the ep ranks span nodes, the hierarchical all-to-all over those nodes;
    whatever else pretrain refuses (ParallelConfig's checks: tp dividing the heads and widths, ep the
    experts, etp the expert width, cp with etp or ep_nodes, a layer per stage, enough micro-batches) is
    skipped."""
    for tp in _divisors(min(devices, devices_per_node)):
        for pp in _divisors(devices // tp):
            for cp in [c for c in _divisors(devices // (tp * pp)) if c <= MAX_CP and seq_len % (2 * c) == 0]:
                dp = devices // (tp * pp * cp)
                if global_batch % dp:
                    continue
                for ep, etp, ep_nodes in _expert_layouts(cfg, dp, cp, tp, devices_per_node):
                    for mbs in micro_batch_sizes:
                        if (global_batch // dp) % mbs:
                            continue
                        microbatches = (global_batch // dp) // mbs if pp > 1 else 1
                        for schedule in SEARCHED_SCHEDULES if pp > 1 else ("1F1B",):
                            for recompute in ("none", "selective", "full"):
                                pc = _checked(devices, cfg, dict(dp_shard=dp, cp=cp, tp=tp, ep=ep, etp=etp,
                                                                 ep_nodes=ep_nodes, pp=pp, pp_schedule=schedule,
                                                                 microbatches=microbatches, recompute=recompute))
                                if pc is not None:
                                    yield pc, mbs


MAX_CP = 16  # context-parallel degrees searched (long sequences on 2·cp chunks)
MAX_ETP = 8  # expert-TP degrees searched (Megatron's expert_tensor_parallel_size is at most a node)


def _expert_layouts(cfg: ModelConfig, dp: int, cp: int, tp: int, devices_per_node: int):
    """(ep, etp, ep_nodes) for dp data-parallel ranks of cp ranks each: ep dividing the experts and dp · cp;
    etp > 1 over the rest of dp (with ep > 1); ep_nodes > 1 (without etp) when the ep·tp ranks span that
    many nodes. Neither etp nor ep_nodes with cp > 1 (ParallelConfig refuses them)."""
    eps = [e for e in _divisors(dp * cp) if cfg.n_routed_experts and cfg.n_routed_experts % e == 0] or [1]
    for ep in eps:
        yield ep, 1, 1
        if cp > 1:
            continue
        if ep > 1:
            for etp in _divisors(dp // ep):
                if 1 < etp <= MAX_ETP:
                    yield ep, etp, 1
        nodes = ep * tp // devices_per_node
        if nodes > 1 and ep * tp % devices_per_node == 0 and ep % nodes == 0:
            yield ep, 1, nodes


def _checked(devices: int, cfg: ModelConfig, keys: dict) -> ParallelConfig | None:
    """The layout with FSDP's bf16 policy, as ParallelConfig accepts it; None if it refuses it."""
    try:
        pc = ParallelConfig(mixed_precision="bf16", **keys)
        pc.validate(devices, cfg)
        return pc
    except ValueError:
        return None


def _unit_step(schedule: str, pp: int, microbatches: int) -> tuple[float, float]:
    """(simulated step, bubble ratio) for stages of F = B = W = 1 (a stage does 3 units per micro-batch)."""
    result = sched.simulate_uniform(schedule, pp, microbatches)
    return result.step_time, result.bubble_ratio


def _bandwidth(cluster: Cluster, group_span: int) -> float:
    """A group of `group_span` consecutive ranks stays in a node when it fits one."""
    return cluster.intra_node_bandwidth if group_span <= cluster.devices_per_node else cluster.inter_node_bandwidth


def _step_time(cfg: ModelConfig, pc: ParallelConfig, cluster: Cluster, mbs: int, per_rank_batch: int,
               seq_len: int) -> tuple[float, float, dict[str, float]]:
    tokens_mb = mbs * seq_len  # a micro-batch's tokens, over the cp ranks of a data-parallel rank
    units = model_units(cfg)
    fwd = bwd = recompute = 0.0
    for u in units:
        f, b = unit_flops(cfg, u, tokens_mb, seq_len)
        fwd, bwd = fwd + f, bwd + b
        recompute += recompute_flops(cfg, u, tokens_mb, seq_len, pc.recompute)
    per_device = pc.tp * pc.pp * pc.cp  # the micro-batch's work is spread over a tp × pp × cp slice
    compute_mb = (fwd + bwd + recompute) / per_device / cluster.flops  # one micro-batch, one stage-rank
    comm = _comm_per_microbatch(cfg, pc, cluster, tokens_mb / pc.cp, seq_len)
    if pc.pp_schedule == "DualPipeV" and pc.pp > 1:
        comm["ep"] = max(0.0, comm["ep"] - compute_mb)
    stage_mb = compute_mb + sum(comm.values())  # one micro-batch through one pp rank
    microbatches = pc.microbatches if pc.pp > 1 else per_rank_batch // mbs
    act_bytes = 2.0 * tokens_mb / pc.cp * cfg.hidden_size
    if pc.pp > 1:
        unit_step, bubble = _unit_step(pc.pp_schedule, pc.pp, microbatches)
        # the unit simulation runs a rank's stages at 3 units per micro-batch each
        pipeline = unit_step / (3 * pc.stages_per_rank) * stage_mb
        pipeline += 2 * (pc.num_stages - 1) * (cluster.p2p_latency + act_bytes / pc.tp / cluster.inter_node_bandwidth)
    else:
        bubble, pipeline = 0.0, microbatches * stage_mb
    dp_comm, exposed_grads = _data_parallel_comm(pc, cluster, units, microbatches)
    exposed_dp = max(0.0, dp_comm - pipeline) + exposed_grads  # FSDP's traffic overlaps the compute it feeds
    step = pipeline + exposed_dp
    times = {"compute": microbatches * compute_mb, "dp exposed": exposed_dp}
    times.update({name: microbatches * t for name, t in comm.items()})
    return step, bubble, times


def _comm_per_microbatch(cfg: ModelConfig, pc: ParallelConfig, cluster: Cluster, tokens: float,
                         seq_len: int = 4096) -> dict[str, float]:
    """Seconds of one micro-batch's TP, CP, EP and expert-TP exchanges on one pp rank (CP's: what the
    compute leaves exposed), `tokens` the micro-batch's tokens on this rank (T/cp of each row of seq_len)."""
    blocks = (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) / pc.pp
    moe_layers = cfg.num_moe_layers / pc.pp
    act_bytes = 2.0 * tokens * cfg.hidden_size
    out = {"tp": 0.0, "cp": 0.0, "ep": 0.0, "etp": 0.0}
    if pc.tp > 1:
        out["tp"] = 4 * blocks * 2 * (pc.tp - 1) / pc.tp * act_bytes / _bandwidth(cluster, pc.tp)
    if pc.cp > 1:
        out["cp"] = blocks * _ring_exposed(cfg, pc, cluster, tokens, seq_len)
    if pc.ep == 1:
        return out
    copies = 2.0 * tokens * cfg.num_experts_per_tok * cfg.hidden_size  # bf16 rows sent per exchange
    if pc.ep_nodes > 1:
        nodes = pc.ep_nodes
        rows = 2.0 * tokens * expected_nodes_per_token(cfg, nodes) * cfg.hidden_size  # (token, node) rows
        per_node = pc.ep // nodes
        cross = (nodes - 1) / nodes * rows / cluster.inter_node_bandwidth
        inside = (per_node - 1) / per_node * copies / _bandwidth(cluster, per_node * pc.tp)
        out["ep"] = 4 * moe_layers * (cross + inside)
    else:
        out["ep"] = 4 * moe_layers * (pc.ep - 1) / pc.ep * copies / _bandwidth(cluster, pc.ep * pc.tp)
    if pc.etp > 1:  # the etp ranks hold the same experts ep·tp ranks apart (parallel/mesh.py's etp view)
        # gate/up pieces sent: (etp−1)/etp of the etp·tokens·K rows, 2I/etp wide, in bf16
        width = 2 * cfg.moe_intermediate_size / pc.tp / pc.etp
        exchange = 2.0 * tokens * cfg.num_experts_per_tok * (pc.etp - 1) * width
        bandwidth = _bandwidth(cluster, pc.etp * pc.ep * pc.tp)
        out["etp"] = moe_layers * (4 * (pc.etp - 1) * copies + 2 * exchange) / bandwidth
    return out


def _ring_exposed(cfg: ModelConfig, pc: ParallelConfig, cluster: Cluster, tokens: float, seq_len: int) -> float:
    """Seconds of one block's ring attention exchange (parallel/cp.py) that its compute leaves exposed. A ring
    step sends one rank's latents (tokens × (r + dr), bf16 under FSDP's bf16 policy) to the next rank while
    this one expands the block it holds (kv_b_proj, its heads) and attends its queries to it (1/cp of the
    core attention): cp − 1 sends forward; backward (2.5× the step's compute) sends the block and its fp32
    latent gradient each step, and waits for the last gradient's hop home with nothing left to hide it."""
    nh = cfg.num_attention_heads / pc.tp
    block = tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    latent_bytes = 2.0 if pc.mixed_precision == "bf16" else 4.0
    bandwidth = _bandwidth(cluster, pc.cp * pc.tp)
    expand = 2.0 * tokens * cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    core = 2.0 * tokens * seq_len / pc.cp * nh * (cfg.qk_head_dim + cfg.v_head_dim)
    step = (expand + core) / cluster.flops
    forward = (pc.cp - 1) * max(0.0, block * latent_bytes / bandwidth - step)
    backward = (pc.cp - 1) * max(0.0, block * (latent_bytes + 4.0) / bandwidth - 2.5 * step)
    return forward + backward + block * 4.0 / bandwidth


def _data_parallel_comm(pc: ParallelConfig, cluster: Cluster, units, microbatches: int) -> tuple[float, float]:
    """(FSDP's traffic, overlapped with the compute; the gradient all-reduce over cp without FSDP, exposed).

    FSDP gathers each block's weights for its forward and again for its backward, and reduce-scatters
    its fp32 gradients, every micro-batch (reshard after forward): (2 or 4) · 2 + 4 bytes per parameter
    over its group, (g−1)/g of them. Dense weights shard over dp_shard · cp, experts over dp_shard · cp / ep."""
    gathered = 2 if pc.mixed_precision == "bf16" else 4
    dense = sum(u.attn_params + u.dense_params for u in units) / (pc.tp * pc.pp)
    experts = sum(u.expert_params for u in units) / (pc.ep * pc.pp)
    if not pc.fsdp:  # cp's ranks all-reduce their fp32 gradients after backward (parallel/cp.py)
        grads = dense + experts
        return 0.0, 2 * (pc.cp - 1) / pc.cp * grads * 4 / _bandwidth(cluster, pc.cp * pc.tp)
    dp_comm = 0.0
    for params, group, span in ((dense, pc.dp_shard * pc.cp, pc.dp_shard * pc.cp * pc.tp),
                                (experts, pc.dp_shard * pc.cp // pc.ep, pc.dp_shard * pc.cp * pc.tp)):
        if group > 1:
            dp_comm += microbatches * params * (2 * gathered + 4) * (group - 1) / group / _bandwidth(cluster, span)
    return dp_comm, 0.0
