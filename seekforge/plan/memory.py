"""Analytic memory dry run: the peak bytes each rank holds during one training step, from configs.

Symbols: B micro-batch, T sequence, N = B·T tokens, H hidden, nh heads, V vocab, I intermediate
sizes, E routed experts, K experts per token, S = N·K routed copies (× skew on an expert-parallel
receiver), a = 2 under bf16 autocast, 4 in fp32.

What a step keeps (train/trainer.py, train/master.py, model/*.py, parallel/*.py; checked against the
profiler's allocation record by benchmarks/plan_memory.py, against LiveBytes by tests/plan/test_memory.py):
  state      fp32 parameters + AdamW's two moments (optimizer_bytes each) — shards of them under FSDP;
             bf16 on plain parameters (one process; cp ranks without FSDP, TP, EP or PP) adds
             train/master.py's persistent bf16 copy and fp32 main gradient of every matmul weight (alive
             all step, between steps too);
  grads      fp32, appear layer by layer in backward, then live until the optimizer step (under master
             weights bf16, added into the main gradients when the pass ends); accumulated over
             micro-batches, each new one exists only until it is added;
  copies     bf16 autocast copies of every matmul weight (autocast caches a leaf weight's cast for
             the whole forward and the backward keeps it; MoE casts its stacked expert weights once
             per layer) — full, unsharded weights even under FSDP, from forward until that unit's
             backward; none under master weights (the weights are bf16 already);
  activations what autograd saves, per unit (`_block`), freed by that unit's backward (an MTP module's
             head call first); with pipelining, as many micro-batches as the schedule keeps in flight
             (plan/schedule.py), and a zero-bubble schedule's I/W split keeps a micro-batch's graph
             and its matmuls' output gradients from I until W;
  workspace  the largest transient of one unit's backward (gradients of its widest tensors) and,
             under FSDP, the gathered weights and the unsharded gradients of the group being computed
             and of the one whose reduce-scatter is in flight.
The peak is the largest of: end of forward, any point of the backward sweep (units backward in
reverse order, each freeing its activations and copies and adding its gradients), the optimizer step.
Ranks differ by pipeline stage (one row per pp rank) and, given per-rank routing, by expert-parallel
rank (`moe_skew` per EP rank); one `moe_skew` plans every EP rank as the busiest.

The other layouts (parallel/cp.py, parallel/ep.py):
  cp         a rank holds T/cp tokens of every row (N = B·T/cp above); FSDP, when on, shards over
             dp_shard × cp; the attention term is `cp_attention_bytes` (ring attention);
  etp        each etp rank stores and computes with I/etp of its E/ep experts, on the rows of all etp
             ranks (etp × its received copies); the gate/up exchange's buffers in backward;
  ep_nodes   HierarchicalDispatcher's combine keeps one (K, H) slot row per arrived (token, node) row.
"""

from __future__ import annotations

from dataclasses import dataclass

from seekforge.config import ModelConfig, ParallelConfig
from seekforge.plan import schedule as sched
from seekforge.plan.shapes import Unit, model_units

GiB = 2**30


@dataclass
class UnitMemory:
    unit: Unit
    params: float  # bytes of fp32 parameters on this rank
    activations: float  # bytes saved for backward, per micro-batch
    copies: float  # bf16 weight copies kept from forward to backward, per micro-batch pass
    workspace: float  # transient peak of this unit's backward
    new_grads: float = 0.0  # gradient bytes this unit's backward creates (fp32, or bf16 under master weights)
    persistent: float = 0.0  # train/master.py's bf16 compute copies and fp32 main gradients, alive all step
    final_grads: float = 0.0  # gradient bytes alive at the optimizer step outside `persistent`
    head_call: float = 0.0  # MTP: its head call's saved bytes, freed (first) before its block's backward
    head_workspace: float = 0.0  # MTP: the logits' gradient while that head call is backwarded
    output_grads: float = 0.0  # the matmuls' output gradients a split backward (I, then W) keeps for W


@dataclass
class RankMemory:
    """One class of ranks (all ranks of a pipeline rank are alike)."""

    name: str
    params: float
    grads: float
    optimizer: float
    activations: float  # peak in-flight activations (all micro-batches the schedule keeps)
    copies: float
    workspace: float
    peak: float
    peak_phase: str

    def rows(self) -> list[tuple[str, float]]:
        return [("parameters", self.params), ("gradients", self.grads), ("optimizer states", self.optimizer),
                ("activations", self.activations), ("bf16 weight copies", self.copies),
                ("backward workspace", self.workspace), ("peak", self.peak)]


@dataclass
class MemoryPlan:
    ranks: list[RankMemory]  # per pipeline rank, per expert-parallel class (pp-major)
    world_size: int
    ep_classes: int = 1  # 1: every EP rank alike (planned as the busiest); else one class per EP rank
    tp: int = 1

    @property
    def peak(self) -> float:
        return max(r.peak for r in self.ranks)

    def rank_of(self, global_rank: int) -> RankMemory:
        """pp is the outermost mesh dimension and ep the one inside tp's (parallel/mesh.py)."""
        pp_rank = global_rank // (self.world_size // (len(self.ranks) // self.ep_classes))
        ep_rank = (global_rank // self.tp) % self.ep_classes
        return self.ranks[pp_rank * self.ep_classes + ep_rank]

    def rank_peak(self, global_rank: int) -> float:
        return self.rank_of(global_rank).peak


def estimate_memory(cfg: ModelConfig, pc: ParallelConfig, micro_batch_size: int, seq_len: int,
                    dtype: str = "bf16", optimizer_bytes: int = 4, moe_skew: float | list[float] = 1.0,
                    split_points: list[int] | None = None, recompute: str | list[str] | None = None,
                    flash_attention: bool = False, collectives_in_flight: bool = True) -> MemoryPlan:
    """Peak bytes per pipeline rank (and, given per-rank routing, per expert-parallel rank) for one step.

    micro_batch_size: sequences per data-parallel rank per step (divided into pc.microbatches under pp);
    dtype: "bf16" (autocast over fp32 master weights) or "fp32"; optimizer_bytes: 4 (fp32 AdamW
    moments) or 2 (bf16); moe_skew: the routed copies an expert-parallel rank receives over the mean.
    The plan cannot know the routing (EP ranks hold equal expert counts: config/parallel.py requires ep
    to divide E, so the token copies they receive are all that differs): one number plans every EP rank
    as the busiest (an upper bound for the others; 1.0 is balanced routing), a list of ep numbers (one
    per EP rank, e.g. from a run's per-rank token counts) gives each EP rank its own row;
    recompute: overrides pc.recompute (one mode, or one per block: main layers then MTP blocks);
    flash_attention: the CUDA path (SDPA keeps q, k, v, its output and a log-sum-exp per row) rather
    than the CPU one (MatmulAttention keeps the (T, T) probabilities); collectives_in_flight: False where
    collectives complete at once (the traced mode's fake process group: no reduce-scatter overlaps).
    Under context parallelism micro_batch_size counts whole rows (the cp ranks of a data-parallel
    rank share them) and seq_len their full length."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: use 'bf16' (autocast) or 'fp32'")
    if optimizer_bytes not in (2, 4):
        raise ValueError(f"optimizer_bytes={optimizer_bytes}: AdamW moments are fp32 (4) or bf16 (2)")
    recompute = pc.recompute if recompute is None else recompute
    units = model_units(cfg)
    blocks = [u for u in units if u.kind in ("dense", "moe", "mtp")]
    modes = [recompute] * len(blocks) if isinstance(recompute, str) else list(recompute)
    if len(modes) != len(blocks):
        raise ValueError(f"recompute lists {len(modes)} modes for {len(blocks)} blocks (main layers, then MTP)")
    mode_of = {u.layer_id: m for u, m in zip(blocks, modes, strict=True)}
    microbatches = pc.microbatches if pc.pp > 1 else 1
    if micro_batch_size % microbatches:
        raise ValueError(f"micro_batch_size={micro_batch_size} (per data-parallel rank) is not divisible by "
                         f"microbatches={microbatches}; make it a multiple of {microbatches}")
    skews = [float(moe_skew)] if isinstance(moe_skew, int | float) else [float(x) for x in moe_skew]
    if len(skews) not in (1, pc.ep) or min(skews) < 0:
        raise ValueError(f"moe_skew={moe_skew!r}: give one number (the busiest EP rank's received copies over the "
                         f"mean) or {pc.ep} non-negative ones, one per EP rank")
    bf16 = dtype == "bf16" or pc.mixed_precision == "bf16"
    if seq_len % (2 * pc.cp):
        raise ValueError(f"cp={pc.cp} splits each row into {2 * pc.cp} chunks, but seq_len={seq_len}; use a "
                         f"multiple of {2 * pc.cp}")
    stages = _stage_units(cfg, pc, units, split_points)
    ranks_of = _ranks_of_stages(pc)
    classes = []  # [pp rank][ep class]
    for ep_rank, skew in enumerate(skews):
        shape = UnitBytes(cfg, pc, micro_batch_size // microbatches, seq_len, 2 if bf16 else 4, skew,
                          flash_attention, collectives_in_flight)
        per_stage = [[shape.unit(u, mode_of.get(u.layer_id, "none")) for u in stage] for stage in stages]
        # Pipeline stages autocast each micro-batch's forward on its own (parallel/pp.py), so every in-flight
        # micro-batch holds its own bf16 weight copies: they count with its activations.
        acts_per_stage = [sum(m.activations + (m.copies if pc.pp > 1 else 0.0) for m in s) for s in per_stage]
        output_grads = [sum(m.output_grads for m in s) for s in per_stage]
        inflight = _inflight_bytes(pc, acts_per_stage, output_grads, shape)
        ranks = [_rank_memory(pc, rank, stage_ids, per_stage, inflight[rank], shape, optimizer_bytes)
                 for rank, stage_ids in enumerate(ranks_of)]
        if len(skews) > 1:
            for r in ranks:
                r.name += f" (EP rank {ep_rank})"
        classes.append(ranks)
    ranks = [classes[e][p] for p in range(len(ranks_of)) for e in range(len(skews))]
    return MemoryPlan(ranks, pc.world_size, len(skews), pc.tp)


def _rank_memory(pc: ParallelConfig, rank: int, stage_ids: list[int], per_stage: list[list[UnitMemory]],
                 inflight: float, shape: UnitBytes, optimizer_bytes: int) -> RankMemory:
    """One pipeline rank's bytes: its state, then the peak over the end of forward, the backward sweep
    and the optimizer step."""
    mems = [m for s in stage_ids for m in per_stage[s]]
    params = sum(m.params for m in mems)
    grads = params  # fp32 gradients of this rank's (sharded) parameters (main gradients under master weights)
    optimizer = params / 4 * 2 * optimizer_bytes
    persistent = sum(m.persistent for m in mems)
    state = params + optimizer + persistent
    copies = sum(m.copies for m in mems) + sum(m.persistent for m in mems) / 3  # the bf16 third of persistent
    fsdp_gather = shape.fsdp_gather(mems)
    if pc.pp > 1:
        # The other in-flight micro-batches stay while one is backwarded through one of this
        # rank's stages (the heaviest): the sweep runs over that stage's units on top of the rest.
        # From the second micro-batch on every gradient exists (each new one is summed into it).
        swept = max((per_stage[s] for s in stage_ids), key=lambda ms: sum(m.activations + m.copies for m in ms))
        one_mb = sum(m.activations + m.copies for m in swept)
        base = state + grads + max(inflight - one_mb, 0.0)
        activations = max(inflight, one_mb)
    else:
        swept, base, activations = mems, state, sum(m.activations for m in mems)
    accumulating = pc.pp > 1 and pc.microbatches > 1
    end_of_forward = base + sum(m.activations + m.copies for m in swept)
    peak, phase, live = end_of_forward, "end of forward", end_of_forward
    for m in reversed(swept):  # the backward sweep, last unit first
        if m.head_call:  # an MTP module's head call first, then its block
            if live + m.head_workspace > peak:
                peak, phase = live + m.head_workspace, f"backward of {m.unit.kind} {m.unit.layer_id}'s head call"
            live -= m.head_call
        # + this unit's new gradients; when they accumulate into existing ones, each is added and freed
        # as it comes: only the largest is ever there at once
        during = live + m.workspace + fsdp_gather + (shape.largest_grad(m) if accumulating else m.new_grads)
        if during > peak:
            peak, phase = during, f"backward of {m.unit.kind} {m.unit.layer_id}"
        if shape.split_backward:  # the input-gradient half keeps the graph and adds the output gradients
            live += m.output_grads
        else:
            live += (0.0 if accumulating else m.new_grads) - (m.activations - m.head_call) - m.copies
    step = state + sum(m.final_grads for m in mems)  # fused AdamW updates in place
    if step > peak:
        peak, phase = step, "optimizer step"
    name = f"pp rank {rank} (stages {', '.join(map(str, stage_ids))})" if pc.pp > 1 else "every rank"
    if pc.ep > 1:
        name += f", EP rank receiving {shape.skew:.2f}× the mean routed copies"
    return RankMemory(name, params, grads, optimizer, activations, copies, max(m.workspace for m in mems), peak,
                      phase)


# ------------------------------------------------------------------------------------------ stages
def _stage_units(cfg: ModelConfig, pc: ParallelConfig, units: list[Unit], split_points) -> list[list[Unit]]:
    """Units per pipeline stage (parallel/pp.py): embedding on the first, head + MTP (and, when the
    first stage is elsewhere, a copy of the embedding for MTP) on the last."""
    if pc.pp == 1:
        return [units]
    n = pc.num_stages
    points = split_points or pc.pp_split_points or [round(i * cfg.num_hidden_layers / n) for i in range(1, n)]
    bounds = [0, *points, cfg.num_hidden_layers]
    layers = [u for u in units if u.kind in ("dense", "moe")]
    stages = [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    embed = units[0]
    stages[0] = [embed, *stages[0]]
    tail = [u for u in units if u.kind in ("head", "mtp")]
    if cfg.num_nextn_predict_layers and pc.stages_per_rank == 1:
        tail = [Unit("embed", -1, dense_params=embed.dense_params), *tail]  # MTP's copy (pp.py)
    stages[-1] = [*stages[-1], *tail]
    return stages


def _ranks_of_stages(pc: ParallelConfig) -> list[list[int]]:
    if pc.pp == 1:
        return [[0]]
    if pc.stages_per_rank == 1:
        return [[r] for r in range(pc.pp)]
    if pc.pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
        return [[r, pc.num_stages - 1 - r] for r in range(pc.pp)]
    return [[r + k * pc.pp for k in range(pc.stages_per_rank)] for r in range(pc.pp)]


def _inflight_bytes(pc: ParallelConfig, acts_per_stage: list[float], output_grads: list[float],
                   shape: UnitBytes) -> list[float]:
    """Per pp rank, the peak activation bytes of the micro-batches the schedule keeps in flight; a
    stage also keeps each in-flight micro-batch's output (its stage cache) until its backward. Between
    a split backward's input-gradient (I) and weight-gradient (W) halves a micro-batch keeps its graph
    and its matmuls' output gradients."""
    if pc.pp == 1:
        return [acts_per_stage[0]]
    kept = [a + shape.stage_output_bytes() for a in acts_per_stage]
    kept[-1] -= shape.stage_output_bytes()  # the last stage's output is the loss
    held = [a + g for a, g in zip(acts_per_stage, output_grads, strict=True)]
    schedule = pc.pp_schedule if pc.pp_schedule in sched.SIMULATED_SCHEDULES else "1F1B"
    simulated = sched.simulate_uniform(schedule, pc.pp, pc.microbatches)
    shape.split_backward = any(e.action.kind == "W" for e in simulated.events)
    return simulated.rank_peak(kept, held)


# ------------------------------------------------------------------------------------------ shapes
class UnitBytes:
    """Bytes of one micro-batch's tensors for each unit kind (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, batch: int, seq_len: int, act_bytes: int,
                 moe_skew: float, flash_attention: bool = False, collectives_in_flight: bool = True):
        self.cfg, self.pc, self.b, self.t, self.a = cfg, pc, batch, seq_len, act_bytes
        self.flash = flash_attention
        self.in_flight = collectives_in_flight
        self.n = batch * seq_len // pc.cp  # tokens on this rank: T/cp of every row
        # Of the model's routed-expert weights, the share one rank stores and computes with (before FSDP):
        # E/ep experts, 1/etp of each under expert-TP.
        self.expert_share = 1 / (pc.ep * pc.etp)
        self.autocast = act_bytes == 2
        # Autocast keeps a bf16 copy of each fp32 weight from forward to backward; FSDP's bf16
        # mixed precision computes on bf16 weights it gathers and frees again (storage resize), so
        # nothing stays (parallel/fsdp.py).
        # bf16 on plain parameters (no pipeline runner, no DTensor: one process, or cp ranks that replicate
        # the weights): train/master.py's persistent bf16 weights instead of autocast's per-forward casts.
        plain = pc.world_size == 1 or (pc.tp == pc.pp == 1 and not pc.fsdp)
        self.master = self.autocast and plain
        self.keeps_copies = self.autocast and pc.mixed_precision == "fp32" and not self.master
        self.skew = moe_skew if pc.ep > 1 else 1.0
        # FSDP shards parameters, gradients and states over dp_shard (× cp: parallel/parallelize.py)
        self.shard = pc.dp_shard * (pc.cp if pc.fsdp else 1)
        self.gathered_dtype = 2 if pc.mixed_precision == "bf16" else 4
        self.latent_bytes = self.gathered_dtype  # the normed c_kv: fp32 unless its norm's weight is bf16
        self.split_backward = False  # a zero-bubble schedule's I/W split (set by _inflight_bytes)

    def stage_output_bytes(self) -> float:
        return 4.0 * self.n * self.cfg.hidden_size  # the fp32 residual stream

    def fsdp_gather(self, mems: list[UnitMemory]) -> float:
        """The largest FSDP group's unsharded weights while it computes, and in its backward its
        unsharded fp32 gradient until the reduce-scatter leaves the shard — and the previous group's,
        whose reduce-scatter is still in flight (FSDP2 overlaps it with this group's backward; gloo
        copies it on a worker thread, a CUDA stream keeps it until the collective ends). Measured on
        gloo (benchmarks/plan_memory.py, the profiler's record): 0 to 3 such copies live at the peak,
        by timing; one is counted, two under expert-TP, whose synchronous all-to-alls over the etp ranks
        (gather, gate/up exchange, reduce-scatter) hold the reduce-scatters back in backward (measured on
        etp=2 × ep=2: 4–13 MiB above LiveBytes' count; 0–12 MiB without etp)."""
        if self.shard == 1 and self.pc.dp_replicate == 1:
            return 0.0
        largest = max((m.unit.attn_params + m.unit.dense_params) / self.pc.tp + m.unit.expert_params * self.expert_share
                       for m in mems)
        in_flight = (2 if self.pc.etp > 1 else 1) if self.in_flight else 0
        return largest * (self.gathered_dtype + 4 + 4 * in_flight)

    def unit(self, u: Unit, mode: str) -> UnitMemory:
        tp = self.pc.tp
        # Experts split over ep ranks, then FSDP-shard over the remaining dp_shard / ep (ep divides
        # dp_shard): 1/dp_shard of them per rank, like every other weight.
        params = 4.0 * ((u.attn_params + u.dense_params) / tp + u.expert_params) / self.shard
        if u.kind == "embed":
            mem = UnitMemory(u, params, 8.0 * self.n, 0.0, 4.0 * u.dense_params / tp)
        elif u.kind == "head":
            mem = self._head(u, params)
        else:
            mem = self._block(u, params, mode)
        mem.new_grads = mem.final_grads = params
        mem.output_grads = self.output_grads(u)
        if self.master:
            # train/master.py: a persistent bf16 copy and fp32 main gradient per matmul weight; backward
            # leaves bf16 gradients, added into the main gradients when the pass ends.
            matmul = 4.0 * self.matmul_params(u)
            mem.persistent = matmul / 4 * (2 + 4)
            mem.final_grads = params - matmul
            mem.new_grads = mem.final_grads + matmul / 2
        return mem

    def largest_grad(self, m: UnitMemory) -> float:
        """The fp32 gradient of a unit's largest parameter: the stacked experts' gate_up (2 of their 3
        matrices), the embedding or the head, else one of the three matrices of a dense MLP, or the
        largest attention projection."""
        u, cfg, tp = m.unit, self.cfg, self.pc.tp
        if u.kind in ("embed", "head"):
            return m.params
        h, nh = cfg.hidden_size, cfg.num_attention_heads / tp
        attention = max(h * nh * cfg.qk_head_dim if not cfg.q_lora_rank else cfg.q_lora_rank * nh * cfg.qk_head_dim,
                        cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), nh * cfg.v_head_dim * h)
        largest = max(attention, u.dense_params / tp / 3 if not u.expert_params else 0.0, u.expert_params * 2 / 3)
        return 4.0 * largest / self.shard

    def output_grads(self, u: Unit) -> float:
        """Bytes of the gradients at a block's matmul outputs. A zero-bubble schedule's input-gradient
        backward (torch.distributed.pipelining's stage_backward_input) keeps them, with the whole
        graph (retain_graph), for the weight-gradient step; the head's are its logits' gradient, which
        replaces the logits the loss saved (counted in its activations)."""
        if u.kind in ("embed", "head"):
            return 0.0
        cfg, n, a, tp = self.cfg, self.n, self.a, self.pc.tp
        h, nh = cfg.hidden_size, cfg.num_attention_heads / tp
        q = (cfg.q_lora_rank or 0) + nh * cfg.qk_head_dim
        kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim + nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        widths = q + kv + h  # + o_proj
        if u.expert_params:
            shared = cfg.n_shared_experts * cfg.moe_intermediate_size / tp
            widths += 2 * shared + h
            routed = a * n * cfg.num_experts_per_tok * self.skew * (2 * cfg.moe_intermediate_size / tp + h)
            router = 4.0 * n * cfg.n_routed_experts
        else:
            widths += 2 * cfg.intermediate_size / tp + h
            routed = router = 0.0
        if u.kind == "mtp":
            widths += h  # eh_proj
        return a * n * widths + routed + router

    def matmul_params(self, u: Unit) -> float:
        """Elements of train/master.py's matmul parameters (Linear weights, stacked experts) in a unit:
        all but the embedding, the RMSNorm gains and the router's weight and bias (unsharded: master
        weights are one process's)."""
        cfg, h = self.cfg, self.cfg.hidden_size
        if u.kind == "embed":
            return 0.0
        if u.kind == "head":
            return u.dense_params - h
        norms = 2 * h + cfg.kv_lora_rank + (cfg.q_lora_rank or 0) + (3 * h if u.kind == "mtp" else 0)
        router = cfg.n_routed_experts * (h + 1) if u.expert_params else 0
        return u.params - norms - router

    def _head(self, u: Unit, params: float) -> UnitMemory:
        cfg, n, a = self.cfg, self.n, self.a
        h, v = cfg.hidden_size, cfg.vocab_size / self.pc.tp
        normed = 2.0 * n * h if self.autocast else 4.0 * n * h  # lm_head's input
        logits = a * n * v  # saved by the chunked cross-entropy (fp32 log-probabilities without autocast)
        saved = 4.0 * n * h + normed + logits + 16.0 * n
        copies = 2.0 * v * h if self.keeps_copies else 0.0
        # backward: the logits' gradient, then the head's weight gradient in bf16 and its fp32 cast (under
        # master weights the bf16 gradient is the gradient, counted by the sweep)
        workspace = a * n * v + (2.0 * v * h if self.autocast and not self.master else 0.0)
        return UnitMemory(u, params, saved, copies, workspace)

    def _block(self, u: Unit, params: float, mode: str) -> UnitMemory:
        cfg, n, a = self.cfg, self.n, self.a
        h, tp = cfg.hidden_size, self.pc.tp
        nh = cfg.num_attention_heads / tp
        residual = 4.0 * n * h
        # Each RMSNorm output feeds two linears: autocast casts it twice (each cast saved), fp32 saves it once.
        norm_out = 2 * 2.0 * n * h if self.autocast else 4.0 * n * h
        extra = self._mtp_extra() if u.kind == "mtp" else 0.0
        attn = self._attention_core(nh)
        q_lora = 8.0 * n * cfg.q_lora_rank if cfg.q_lora_rank else 0.0
        r = cfg.kv_lora_rank
        kv = 8.0 * n * r if self.autocast else 4.0 * n * (r + cfg.qk_rope_head_dim) + 4.0 * n * r
        if self.pc.cp > 1:  # kv_b_proj runs inside the ring attention, on the latents cp_attention_bytes saves
            kv -= (2.0 if self.autocast else 4.0) * n * r
        attention = residual + norm_out + q_lora + kv + attn
        moe = u.expert_params > 0
        if moe:
            mlp, experts_saved, experts_internal, expert_copies = self._moe(u)
        else:
            inter = cfg.intermediate_size / tp
            mlp = residual + norm_out + 3 * a * n * inter  # model/moe.py's _SwiGLU saves gate and up; the product
            experts_saved = experts_internal = expert_copies = 0.0
        copies = 2.0 * (u.attn_params + u.dense_params) / tp if self.keeps_copies else 0.0
        copies += expert_copies
        if mode == "full":
            saved = residual + extra  # the block input (and the MTP module's own pieces)
            recompute_peak = attention + mlp + experts_saved + experts_internal
            workspace = recompute_peak + self._backward_workspace(u, nh) + copies
            return self._with_head_call(UnitMemory(u, params, saved, 0.0, workspace))
        if mode == "selective":
            attention = residual + (4.0 * n * h)  # the wrapper keeps the attention's (fp32) normed input
            saved = attention + mlp + experts_saved + extra
            copies = 2.0 * u.dense_params / tp if self.keeps_copies else 0.0
            workspace = self._backward_workspace(u, nh) + attn + experts_internal + expert_copies
            workspace += 2.0 * u.attn_params / tp if self.keeps_copies else 0.0
            return self._with_head_call(UnitMemory(u, params, saved, copies, workspace))
        saved = attention + mlp + experts_saved + experts_internal + extra
        return self._with_head_call(UnitMemory(u, params, saved, copies, self._backward_workspace(u, nh)))

    def _with_head_call(self, mem: UnitMemory) -> UnitMemory:
        """An MTP module's head call is backwarded before its block: its logits and their gradient are
        gone when the block's own transients peak."""
        if mem.unit.kind == "mtp":
            mem.head_call, mem.head_workspace = self._mtp_head()
        return mem

    def _mtp_extra(self) -> float:
        """What an MTP module keeps besides its block's usual share: the embedding lookup (saved by
        enorm), eh_proj's input [enorm(emb); hnorm(h)], its head call (norm input, head input,
        logits) — and, under autocast, 2NH more in each of its block's two norms, whose input is
        eh_proj's bf16 output (an fp32 copy and the normed bf16 input are saved)."""
        n, h = self.n, self.cfg.hidden_size
        if self.autocast:
            eh_input = 2.0 * n * 2 * h
            block_norms = 2 * 2.0 * n * h
        else:
            eh_input, block_norms = 8.0 * n * h, 0.0
        return 4.0 * n * h + eh_input + block_norms + self._mtp_head()[0]

    def _mtp_head(self) -> tuple[float, float]:
        """(saved, backward workspace) of an MTP module's call of the shared head: the norm's input (and
        its bf16 output under autocast), the logits, the targets and log-sum-exp per row; the logits'
        gradient."""
        cfg, n, h, a = self.cfg, self.n, self.cfg.hidden_size, self.a
        logits = a * n * cfg.vocab_size / self.pc.tp
        norm = (4.0 + 2.0) * n * h if self.autocast else 4.0 * n * h
        return norm + logits + 16.0 * n, logits

    def _attention_core(self, nh: float) -> float:
        """MatmulAttention saves the scaled q, k, v and the probabilities; o_proj its (B, T, nh·dv) input.
        SDPA (flash) saves q and k (the cat outputs), kv_b_proj's output (v is a view of it), its own
        output and a log-sum-exp per row and head. Under context parallelism: cp_attention_bytes."""
        cfg, n, a = self.cfg, self.n, self.a
        if self.pc.cp > 1:
            return cp_attention_bytes(cfg, self.b, self.t, self.pc.cp, nh, a, self.latent_bytes)[0]
        if self.flash:
            kv_b_out = a * n * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            return a * n * nh * 2 * cfg.qk_head_dim + kv_b_out + 2 * a * n * nh * cfg.v_head_dim + 4.0 * n * nh
        qkv = a * n * nh * (2 * cfg.qk_head_dim + cfg.v_head_dim)
        probs = a * self.b * nh * self.t * self.t
        return qkv + probs + a * n * nh * cfg.v_head_dim

    def _moe(self, u: Unit) -> tuple[float, float, float, float]:
        """(saved outside the routed experts, saved at the experts' inputs and the combine,
        saved inside the experts, bf16 expert weight copies)."""
        cfg, n, a, tp = self.cfg, self.n, self.a, self.pc.tp
        h, e, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
        s = n * k
        received = s * self.skew
        rows = received * self.pc.etp  # expert-TP: the etp ranks' copies, gathered
        inter = cfg.moe_intermediate_size / tp / self.pc.etp
        shared_inter = cfg.n_shared_experts * cfg.moe_intermediate_size / tp
        residual = 4.0 * n * h
        if self.autocast:  # the router's cast input, and x cast once for the shared experts and dispatch
            inputs = 2.0 * n * h + 2.0 * n * h
        else:
            inputs = 4.0 * n * h
        router = a * n * e + 8.0 * n * k + 2 * a * n * k
        shared = 3 * a * n * shared_inter  # gate and up (saved by _SwiGLU), the product (down_proj's input)
        dispatch = 8.0 * s * 2  # the sort order and its inverse (int64)
        outside = residual + inputs + router + shared + dispatch
        at_experts = a * rows * h + a * s * h  # expert input copies; the unsorted outputs in combine
        inside = a * rows * (2 * inter + inter)  # gate_up output (saved by _SwiGLU), the product
        copies = 2.0 * u.expert_params * self.expert_share if self.keeps_copies else 0.0
        if self.pc.ep > 1:
            # the received rows before the grouped GEMM pads them per expert (_as_run), kept beside the
            # padded copy: the etp ranks' gathered rows under expert-TP
            at_experts += a * s * self.pc.etp * h
        if self.pc.ep_nodes > 1:
            # HierarchicalDispatcher's combine weights a (K, H) slot row per arrived (token, node) row
            # (zeros where the expert is on another node) where the flat one weights the S copies
            at_experts += a * h * k * (self._node_rows() - n)
        return outside, at_experts, inside, copies

    def _node_rows(self) -> float:
        """(token, node) rows arriving at a rank, per N tokens of its own: N × the nodes a token reaches
        (balanced routing: the expected distinct nodes of K experts drawn from E, at most the routing's
        node limit, parallel/ep.py's nodes_per_token) × this rank's skew."""
        return self.n * expected_nodes_per_token(self.cfg, self.pc.ep_nodes) * self.skew

    def _backward_workspace(self, u: Unit, nh: float) -> float:
        """The widest transients of a block's backward: the attention scores' two gradients, or the
        stacked experts' weight gradient in bf16 (its fp32 cast is the unit's gradient, counted by the
        sweep); whichever is larger."""
        a = self.a
        if self.pc.cp > 1:
            scores = cp_attention_bytes(self.cfg, self.b, self.t, self.pc.cp, nh, a, self.latent_bytes)[1]
        else:
            scores = 0.0 if self.flash else 2 * a * self.b * nh * self.t * self.t
        experts = 0.0
        if u.expert_params:
            per_proj = u.expert_params / self.pc.ep * 2 / 3  # gate_up is 2 of the 3 expert matrices
            experts = per_proj / self.pc.etp * (2.0 if self.autocast and not self.master else 0.0)
        return max(scores, experts, self._etp_exchange(u))

    def _etp_exchange(self, u: Unit) -> float:
        """Expert-TP's gate/up exchange in backward (EtpDispatcher.exchange): the gradient of the (rows,
        2I/etp) first GEMM output arrives as [gate | up] of this rank's slice, is cut into pieces by
        destination and sent back, and the arrived pieces are put back in stored order: three such
        buffers at once, besides the gradient itself (the sweep's)."""
        if self.pc.etp == 1 or not u.expert_params:
            return 0.0
        rows = self.n * self.cfg.num_experts_per_tok * self.skew * self.pc.etp
        return 3 * self.a * rows * 2 * self.cfg.moe_intermediate_size / self.pc.tp / self.pc.etp


def cp_attention_bytes(cfg: ModelConfig, batch: int, seq_len: int, cp: int, nh: float, act_bytes: int,
                       latent_bytes: int = 4) -> tuple[float, float]:
    """(saved for backward, backward workspace) of one MLA's ring attention on one cp rank (parallel/cp.py's
    _RingAttention; CPU and GPU alike), B rows of T tokens, Tl = T/cp of each here, nh heads per rank.

    Saved: the scaled q (B, nh, Tl, dqk), this rank's latents [c_kv; k_pe] (B, Tl, r + dr; fp32 unless
    the weights are bf16: c_kv leaves an fp32-weighted norm), the output (B, Tl, nh, dv, the storage o_proj
    keeps) and an fp32 LSE (B, nh, Tl). A backward ring step adds: the visiting block re-expanded (k, v and
    kv_b_proj's output), its fp32 dK/dV, the whole fp32 dq, dO transposed and Σ dO·O per row, the block in
    flight and two fp32 latent gradients (this step's and the travelling one); then either a few fp32
    (B, nh, T/2cp, T/2cp) tiles (the loop) or kv_b_proj's output gradient (its end, where dK/dV are cat
    into one tensor each: measured, the peak of an i44 cp=2 step is there)."""
    a, local = act_bytes, batch * seq_len // cp  # tokens on this rank
    r, dr, dn, dv, dqk = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
                          cfg.qk_head_dim)
    latents = latent_bytes * local * (r + dr)
    saved = a * local * nh * (dqk + dv) + latents + 4.0 * local * nh
    expanded = a * local * nh * (dqk + dv + dn + dv)
    grad_kv = 4.0 * local * nh * (dqk + dv)
    step = expanded + grad_kv + 4.0 * local * nh * dqk + a * local * nh * dv + 4.0 * local * nh
    step += latents + 2 * 4.0 * local * (r + dr)
    tiles = 3 * 4.0 * batch * nh * (seq_len / (2 * cp)) ** 2
    return saved, step + max(tiles, a * local * nh * (dn + dv))


def expected_nodes_per_token(cfg: ModelConfig, ep_nodes: int) -> float:
    """The nodes one token's K copies reach on average under balanced routing: the expected number of
    distinct nodes among K of E experts drawn uniformly (E/ep_nodes per node), at most the routing's
    node limit (parallel/ep.py's nodes_per_token, which is topk_group when groups map to nodes)."""
    from math import comb

    from seekforge.parallel.ep import nodes_per_token

    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if ep_nodes == 1 or not e:
        return 1.0
    missed = comb(e - e // ep_nodes, k) / comb(e, k)  # a given node holds none of the K
    return min(ep_nodes * (1 - missed), float(nodes_per_token(cfg, ep_nodes)))


def format_plan(plan: MemoryPlan) -> str:
    """A table, one row per rank class, in GiB."""
    labels = [label for label, _ in plan.ranks[0].rows()]
    width = max(len(r.name) for r in plan.ranks)
    short = {"parameters": "params", "gradients": "grads", "optimizer states": "optim", "activations": "activ",
             "bf16 weight copies": "copies", "backward workspace": "workspace", "peak": "peak"}
    lines = [f"{'GiB':<{width}}" + "".join(f"{short[label]:>10}" for label in labels) + "  peak when"]
    for r in plan.ranks:
        lines.append(f"{r.name:<{width}}" + "".join(f"{value / GiB:>10.2f}" for _, value in r.rows())
                     + f"  {r.peak_phase}")
    return "\n".join(lines)
