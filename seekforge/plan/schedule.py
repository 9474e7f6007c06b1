"""Event-level pipeline schedule simulator.

The order in which each pipeline rank runs its forward (F), input-gradient backward (I), weight-gradient
backward (W) and full backward (B = I + W) actions is read from `torch.distributed.pipelining` itself
(`_get_pipeline_order` / `_calculate_single_rank_operations`), so the simulated schedules are the ones
`parallel/pp.py` runs. The simulator only adds time: every action starts when its rank is free and its
inputs exist (the previous stage's F, the next stage's I/B, plus a p2p latency across ranks), and
lasts its stage's cost.

Outputs: step time, bubble (idle time inside a rank's span, as the Zero Bubble paper counts it), the
peak number of micro-batches whose activations a stage holds (F started, I/B not finished), and a
timeline picture.

"ZB-H1" is torch's InterleavedZeroBubble (ZB1P) with one stage per rank, the Zero Bubble paper's
ZB-H1; it is simulated but not a `--parallel` schedule (seekforge runs InterleavedZeroBubble with two
stages per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from torch.distributed.pipelining import schedules as torch_schedules

SIMULATED_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZB-H1", "ZBVZeroBubble",
                       "DualPipeV", "LoopedBFS")
_F, _I, _W, _B = "F", "I", "W", "B"


@dataclass(frozen=True)
class StageCost:
    """Seconds one micro-batch spends in one pipeline stage. `recompute` is the forward rerun that
    activation checkpointing adds in front of the backward."""

    forward: float
    backward_input: float
    backward_weight: float
    recompute: float = 0.0


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # "F", "I", "W" or "B"
    microbatch: int


@dataclass
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    schedule: str
    step_time: float
    bubble_time: float  # the largest idle time of a rank between its first and its last action
    bubble_ratio: float  # bubble_time / that rank's compute time (the Zero Bubble paper's "bubble rate")
    peak_inflight: list[int]  # per stage: micro-batches holding activations at once
    stage_to_rank: list[int]
    events: list[Event]
    _deltas: list[tuple[int, int]] | None = None

    def rank_peak(self, bytes_per_microbatch: list[float]) -> list[float]:
        """Per rank, the peak of Σ over its stages of (live micro-batches × that stage's bytes)."""
        live, peak = [0.0] * (max(self.stage_to_rank) + 1), [0.0] * (max(self.stage_to_rank) + 1)
        for stage, sign in self._activation_deltas():
            rank = self.stage_to_rank[stage]
            live[rank] += sign * bytes_per_microbatch[stage]
            peak[rank] = max(peak[rank], live[rank])
        return peak

    def _activation_deltas(self) -> list[tuple[int, int]]:
        """(stage, +1 | -1) in time order: a forward's start holds a micro-batch's activations, the end
        of its input-gradient (or full) backward frees them; at equal times the free comes first."""
        if self._deltas is None:
            deltas = []
            for e in self.events:
                if e.action.kind == _F:
                    deltas.append((e.start, 1, e.action.stage, 1))
                elif e.action.kind in (_I, _B):
                    deltas.append((e.end, 0, e.action.stage, -1))
            self._deltas = [(stage, sign) for _, _, stage, sign in sorted(deltas)]
        return self._deltas


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in ("GPipe", "1F1B", "ZB-H1") else 2


def pipeline_actions(schedule: str, pp: int, microbatches: int) -> dict[int, list[Action]]:
    """Each rank's compute actions in execution order, as torch.distributed.pipelining orders them.

    The schedule classes compute their order in __init__ from a stage's group size, rank and stage
    count only; stand-in stage objects with those fields give the order without a process group."""
    if schedule not in SIMULATED_SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not simulated; choose one of {SIMULATED_SCHEDULES}")
    if schedule == "1F1B":
        return {rank: _one_f_one_b(rank, pp, microbatches) for rank in range(pp)}
    torch_name = "InterleavedZeroBubble" if schedule == "ZB-H1" else schedule
    cls = torch_schedules.get_schedule_class(torch_name)
    local = stages_per_rank(schedule)
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * local, submod=None, stage_index=i)
              for i in range(local)]
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    order = cls(stages[0] if single else stages, microbatches).pipeline_order
    return {rank: _compute_actions(order[rank]) for rank in range(pp)}


def _one_f_one_b(rank: int, pp: int, microbatches: int) -> list[Action]:
    """Schedule1F1B's order as its runtime loop runs it (`_step_microbatches`: min(m, pp - rank) warm-up
    forwards, then backward/forward pairs, then the remaining backwards). Its `_get_pipeline_order`, a
    visualization aid the runtime does not use, skips micro-batch 0 on the last rank in torch 2.13."""
    warmup = min(microbatches, pp - rank)
    order = [Action(rank, _F, mb) for mb in range(warmup)]
    for mb in range(microbatches):
        order.append(Action(rank, _B, mb))
        if warmup + mb < microbatches:
            order.append(Action(rank, _F, warmup + mb))
    return order


def _compute_actions(raw: list) -> list[Action]:
    out = []
    for a in raw:
        if a is None:
            continue
        parts = a.sub_actions if a.sub_actions is not None else (a,)  # OVERLAP_F_B: its F and B in turn
        for p in parts:
            kind = p.computation_type.value
            if kind in (_F, _I, _W, _B):
                out.append(Action(p.stage_index, kind, p.microbatch_index))
    return out


def simulate(schedule: str, costs: list[StageCost], microbatches: int, p2p_latency: float = 0.0) -> SimResult:
    """Run `schedule` with one StageCost per stage (len = pp × stages per rank) and time every action."""
    local = stages_per_rank(schedule)
    if len(costs) % local:
        raise ValueError(f"{schedule} puts {local} stages on each rank; got {len(costs)} stage costs")
    pp = len(costs) // local
    actions = pipeline_actions(schedule, pp, microbatches)
    stage_to_rank = [0] * len(costs)
    for rank, acts in actions.items():
        for a in acts:
            stage_to_rank[a.stage] = rank
    last = len(costs) - 1

    def duration(a: Action) -> float:
        c = costs[a.stage]
        return {_F: c.forward, _I: c.recompute + c.backward_input, _W: c.backward_weight,
                _B: c.recompute + c.backward_input + c.backward_weight}[a.kind]

    def ready_time(a: Action, done: dict) -> float | None:
        """When a's input exists (None: not yet produced)."""
        if a.kind == _F:
            dep = (a.stage - 1, _F) if a.stage else None
        elif a.kind == _W:
            dep = (a.stage, _I)
        else:
            dep = (a.stage, _F) if a.stage == last else (a.stage + 1, "IB")
        if dep is None:
            return 0.0
        stage, kind = dep
        keys = [(stage, k, a.microbatch) for k in (("I", "B") if kind == "IB" else (kind,))]
        finished = [done[k] for k in keys if k in done]
        if not finished:
            return None
        hop = p2p_latency if stage_to_rank[stage] != stage_to_rank[a.stage] else 0.0
        return finished[0] + hop

    done: dict[tuple[int, str, int], float] = {}
    cursor, free_at = [0] * pp, [0.0] * pp
    events: list[Event] = []
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for rank in range(pp):
            while cursor[rank] < len(actions[rank]):
                a = actions[rank][cursor[rank]]
                ready = ready_time(a, done)
                if ready is None:
                    break
                start = max(ready, free_at[rank])
                end = start + duration(a)
                done[(a.stage, a.kind, a.microbatch)] = end
                events.append(Event(rank, a, start, end))
                free_at[rank], cursor[rank] = end, cursor[rank] + 1
                remaining -= 1
                progressed = True
        assert progressed, f"{schedule}: action order deadlocks at {[actions[r][cursor[r]] for r in range(pp)]}"

    # Bubble as the Zero Bubble paper (§2) and DeepSeek's DualPipe table count it: idle time inside each
    # rank's own span; a rank's wait for its first input (the warm-up ramp) is not a bubble.
    idle = []
    for rank in range(pp):
        mine = [e for e in events if e.rank == rank]
        busy = sum(e.end - e.start for e in mine)
        idle.append((max(e.end for e in mine) - min(e.start for e in mine) - busy, busy))
    bubble, busy = max(idle)
    result = SimResult(schedule, max(free_at), bubble, bubble / busy if busy else 0.0, [], stage_to_rank, events)
    live = [0] * len(costs)
    result.peak_inflight = [0] * len(costs)
    for stage, sign in result._activation_deltas():
        live[stage] += sign
        result.peak_inflight[stage] = max(result.peak_inflight[stage], live[stage])
    return result


def draw_timeline(result: SimResult, path: str) -> None:
    """A PNG with one row per rank; F, I, W and B coloured, the micro-batch number on each box."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {_F: "#4c72b0", _I: "#dd8452", _W: "#55a868", _B: "#c44e52"}
    ranks = max(result.stage_to_rank) + 1
    fig, ax = plt.subplots(figsize=(14, 0.6 * ranks + 1.2))
    for e in result.events:
        ax.broken_barh([(e.start, e.end - e.start)], (e.rank - 0.4, 0.8), facecolors=colours[e.action.kind],
                       edgecolors="white", linewidth=0.5)
        if result.step_time and (e.end - e.start) / result.step_time > 0.012:
            ax.text((e.start + e.end) / 2, e.rank, str(e.action.microbatch), ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{result.schedule}: step {result.step_time:.4g}, bubble {result.bubble_ratio:.1%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, ["F", "I (input grad)", "W (weight grad)", "B (full backward)"], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 / max(1, ranks / 4)), fontsize=7, ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def uniform_costs(schedule: str, pp: int, forward: float, backward_input: float, backward_weight: float,
                  recompute: float = 0.0) -> list[StageCost]:
    """The same cost on every stage; for V/interleaved schedules each stage is one of a rank's chunks."""
    return [StageCost(forward, backward_input, backward_weight, recompute)] * (pp * stages_per_rank(schedule))



@lru_cache(maxsize=1024)
def simulate_uniform(schedule: str, pp: int, microbatches: int) -> SimResult:
    """simulate() with F = B = W = 1 on every stage, cached: the memory estimate and the strategy
    search ask for the same few (schedule, pp, microbatches) again and again. Do not mutate the result."""
    return simulate(schedule, uniform_costs(schedule, pp, 1.0, 1.0, 1.0), microbatches)
