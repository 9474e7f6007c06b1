"""Event-level pipeline schedule simulator.

The order in which each pipeline rank runs its forward (F), input-gradient backward (I), weight-gradient
backward (W) and full backward (B = I + W) actions is read from `torch.distributed.pipelining` itself
(`_get_pipeline_order` / `_calculate_single_rank_operations`), so the simulated schedules are the ones
`parallel/pp.py` runs. The simulator only adds time: every action starts when its rank is free and its
inputs exist (the previous stage's F, the next stage's I/B, plus a p2p latency across ranks), and
lasts its stage's cost.

DualPipeV's OVERLAP_F_B actions (a forward of one local stage with a full backward of the other) are
one unit here, as in both runtimes that run them: torch's `_add_send_recv` receives both inputs before
the unit and sends both outputs after it, and DeepSeek's `dualpipev.py` (`_forward_backward_chunk`)
waits on both receives, computes, then sends both. The unit lasts F + B - `overlap`: DeepSeek's F&B,
the time of "two mutually overlapped forward and backward chunks"; `overlap` = 0 (the default) is
torch's runtime, which runs the two one after the other.

Outputs: step time, bubble (see `simulate`), the peak number of micro-batches whose activations a
stage holds (F started, I/B not finished), and a timeline picture.

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
    overlapped: bool = False  # one half of an F&B unit (its share of the unit's time, for the picture)


@dataclass
class SimResult:
    schedule: str
    step_time: float
    bubble_time: float  # idle time per step of the most idle rank when steps run back to back (simulate)
    bubble_ratio: float  # bubble_time / that rank's compute time (the Zero Bubble paper's "bubble rate")
    peak_inflight: list[int]  # per stage: micro-batches holding activations at once
    stage_to_rank: list[int]
    events: list[Event]
    _deltas: list[tuple[int, str]] | None = None

    def rank_peak(self, bytes_per_microbatch: list[float], held_for_weight: list[float] | None = None) -> list[float]:
        """Per rank, the peak of Σ over its stages of (live micro-batches × that stage's bytes).
        held_for_weight: per stage, the part of a micro-batch's bytes its input-gradient backward (I)
        leaves for the weight-gradient one (W): the weights' inputs and their outputs' gradients."""
        held = held_for_weight or [0.0] * len(bytes_per_microbatch)
        live, peak = [0.0] * (max(self.stage_to_rank) + 1), [0.0] * (max(self.stage_to_rank) + 1)
        for stage, kind in self._activation_deltas():
            rank = self.stage_to_rank[stage]
            full = bytes_per_microbatch[stage]
            live[rank] += {_F: full, _B: -full, _I: held[stage] - full, _W: -held[stage]}[kind]
            peak[rank] = max(peak[rank], live[rank])
        return peak

    def _activation_deltas(self) -> list[tuple[int, str]]:
        """(stage, action kind) in time order: a forward's start holds a micro-batch's activations, the
        end of its full backward (B) frees them, that of its input-gradient backward (I) all but what the
        weight-gradient one (W) needs, which W's end frees; at equal times the frees come first."""
        if self._deltas is None:
            deltas = []
            for e in self.events:
                if e.action.kind == _F:
                    deltas.append((e.start, 1, e.action.stage, _F))
                else:
                    deltas.append((e.end, 0, e.action.stage, e.action.kind))
            self._deltas = [(stage, kind) for _, _, stage, kind in sorted(deltas)]
        return self._deltas


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in ("GPipe", "1F1B", "ZB-H1") else 2


def pipeline_actions(schedule: str, pp: int, microbatches: int) -> dict[int, list[tuple[Action, ...]]]:
    """Each rank's compute units in execution order, as torch.distributed.pipelining orders them: one
    action, or DualPipeV's overlapped (forward, full backward) pair.

    The schedule classes compute their order in __init__ from a stage's group size, rank and stage
    count only; stand-in stage objects with those fields give the order without a process group."""
    if schedule not in SIMULATED_SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not simulated; choose one of {SIMULATED_SCHEDULES}")
    if schedule == "1F1B":
        return {rank: [(a,) for a in _one_f_one_b(rank, pp, microbatches)] for rank in range(pp)}
    torch_name = "InterleavedZeroBubble" if schedule == "ZB-H1" else schedule
    cls = torch_schedules.get_schedule_class(torch_name)
    local = stages_per_rank(schedule)
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * local, submod=None, stage_index=i)
              for i in range(local)]
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    order = cls(stages[0] if single else stages, microbatches).pipeline_order
    return {rank: _compute_units(order[rank]) for rank in range(pp)}


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


def _compute_units(raw: list) -> list[tuple[Action, ...]]:
    out = []
    for a in raw:
        if a is None:
            continue
        parts = a.sub_actions if a.sub_actions is not None else (a,)  # OVERLAP_F_B: (F, B) as one unit
        unit = tuple(Action(p.stage_index, p.computation_type.value, p.microbatch_index) for p in parts
                     if p.computation_type.value in (_F, _I, _W, _B))
        if unit:
            out.append(unit)
    return out


def simulate(schedule: str, costs: list[StageCost], microbatches: int, p2p_latency: float = 0.0,
             overlap: float = 0.0) -> SimResult:
    """Run `schedule` with one StageCost per stage (len = pp × stages per rank) and time every action.

    `overlap`: seconds a DualPipeV F&B unit saves over running its forward and full backward back to
    back; the unit lasts F + B - overlap (DeepSeek's F&B), between max(F, B) and F + B.

    Bubble: each rank's idle time per step when steps run back to back, the largest over ranks. Repeating
    the simulated step every P = (the longest span of one rank's first start to its last end) keeps
    every dependency and never overlaps a rank with itself, so rank r idles P - (its compute) per step.
    Where every rank computes the same (equal stage costs; no DualPipeV overlap) this is the largest idle
    time inside one rank's span: the Zero Bubble paper's count (§2: 1F1B (p-1)(F+B+W); ZB-V and ZB-H2
    are "zero bubble" because their staggered starts and ends interlock across steps). For DualPipeV it
    is what every device row of DeepSeek's DualPipe README picture shows, warm-up included (the last
    rank's first forward waits every step, as rank 0 ends each step last): (n-1)(F&B + F - 2W) for n
    ranks, W <= B - W <= F, B the full backward; the README's (PP/2-1)(F&B + B - 3W) where B - W = F,
    as its picture draws it. tests/plan/test_dualpipev.py derives it."""
    local = stages_per_rank(schedule)
    if len(costs) % local:
        raise ValueError(f"{schedule} puts {local} stages on each rank; got {len(costs)} stage costs")
    if overlap and schedule != "DualPipeV":
        raise ValueError(f"overlap applies to DualPipeV's overlapped F&B units; {schedule} has none: drop it")
    units = pipeline_actions(schedule, len(costs) // local, microbatches)
    stage_to_rank = _stage_to_rank(units, len(costs))
    events, free_at = _run(schedule, units, costs, stage_to_rank, p2p_latency, overlap)
    bubble, work = _bubble(events, len(units))
    result = SimResult(schedule, max(free_at), bubble, bubble / work if work else 0.0, [], stage_to_rank, events)
    result.peak_inflight = _peak_inflight(result, len(costs))
    return result


def _stage_to_rank(units: dict[int, list[tuple[Action, ...]]], num_stages: int) -> list[int]:
    stage_to_rank = [0] * num_stages
    for rank, rank_units in units.items():
        for unit in rank_units:
            for a in unit:
                stage_to_rank[a.stage] = rank
    return stage_to_rank


def _run(schedule: str, units: dict[int, list[tuple[Action, ...]]], costs: list[StageCost],
         stage_to_rank: list[int], p2p_latency: float, overlap: float) -> tuple[list[Event], list[float]]:
    """Every unit's events, each unit started in its rank's order as soon as the rank is free and the
    unit's inputs exist; and the time each rank ends."""
    pp = len(units)
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, micro-batch) → when its output exists
    cursor, free_at = [0] * pp, [0.0] * pp
    events: list[Event] = []
    remaining = sum(len(u) for u in units.values())
    while remaining:
        progressed = False
        for rank in range(pp):
            while cursor[rank] < len(units[rank]):
                unit = units[rank][cursor[rank]]
                inputs = [_ready_time(a, done, stage_to_rank, p2p_latency) for a in unit]
                if None in inputs:
                    break
                timed = _time_unit(rank, unit, max([free_at[rank], *inputs]), costs, overlap)
                events += timed
                for a in unit:  # a pair's outputs leave together, after the unit
                    done[(a.stage, a.kind, a.microbatch)] = timed[-1].end
                free_at[rank], cursor[rank] = timed[-1].end, cursor[rank] + 1
                remaining -= 1
                progressed = True
        assert progressed, f"{schedule}: action order deadlocks at {[units[r][cursor[r]] for r in range(pp)]}"
    return events, free_at


def _ready_time(a: Action, done: dict, stage_to_rank: list[int], p2p_latency: float) -> float | None:
    """When a's input exists (None: not yet produced): the previous stage's F for an F, the same
    stage's I for a W, the next stage's I or B (the last stage: its own F) for an I or B."""
    if a.kind == _F:
        if not a.stage:
            return 0.0
        stage, kinds = a.stage - 1, (_F,)
    elif a.kind == _W:
        stage, kinds = a.stage, (_I,)
    elif a.stage == len(stage_to_rank) - 1:
        stage, kinds = a.stage, (_F,)
    else:
        stage, kinds = a.stage + 1, (_I, _B)
    finished = [done[key] for key in ((stage, kind, a.microbatch) for kind in kinds) if key in done]
    if not finished:
        return None
    hop = p2p_latency if stage_to_rank[stage] != stage_to_rank[a.stage] else 0.0
    return finished[0] + hop


def _duration(a: Action, costs: list[StageCost]) -> float:
    c = costs[a.stage]
    return {_F: c.forward, _I: c.recompute + c.backward_input, _W: c.backward_weight,
            _B: c.recompute + c.backward_input + c.backward_weight}[a.kind]


def _time_unit(rank: int, unit: tuple[Action, ...], start: float, costs: list[StageCost],
               overlap: float) -> list[Event]:
    """The events of one unit from `start`: one action, or an F&B pair lasting F + B - overlap, each
    half drawn over its share of the pair's time."""
    serial = [_duration(a, costs) for a in unit]
    if len(unit) == 2 and not 0.0 <= overlap <= min(serial):
        raise ValueError(f"overlap {overlap} must lie in [0, {min(serial)}] (F&B is at least the "
                         f"longer of its forward {serial[0]} and backward {serial[1]})")
    scale = (sum(serial) - overlap) / sum(serial) if len(unit) == 2 else 1.0
    events, t = [], start
    for a, d in zip(unit, serial, strict=True):
        events.append(Event(rank, a, t, t + d * scale, overlapped=len(unit) == 2))
        t += d * scale
    return events


def _bubble(events: list[Event], pp: int) -> tuple[float, float]:
    """(idle time per step of the most idle rank, that rank's compute time); see simulate."""
    busy, first, end = [0.0] * pp, [float("inf")] * pp, [0.0] * pp
    for e in events:
        busy[e.rank] += e.end - e.start
        first[e.rank], end[e.rank] = min(first[e.rank], e.start), max(end[e.rank], e.end)
    period = max(end[r] - first[r] for r in range(pp))
    return max((period - busy[r], busy[r]) for r in range(pp))


def _peak_inflight(result: SimResult, num_stages: int) -> list[int]:
    live, peak = [0] * num_stages, [0] * num_stages
    for stage, kind in result._activation_deltas():
        live[stage] += {_F: 1, _I: -1, _B: -1, _W: 0}[kind]
        peak[stage] = max(peak[stage], live[stage])
    return peak


def draw_timeline(result: SimResult, path: str) -> None:
    """A PNG with one row per rank; F, I, W and B coloured, the micro-batch number on each box, the two
    halves of an overlapped F&B unit edged in black (as DeepSeek draws them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {_F: "#4c72b0", _I: "#dd8452", _W: "#55a868", _B: "#c44e52"}
    ranks = max(result.stage_to_rank) + 1
    fig, ax = plt.subplots(figsize=(14, 0.6 * ranks + 1.2))
    for e in result.events:
        ax.broken_barh([(e.start, e.end - e.start)], (e.rank - 0.4, 0.8), facecolors=colours[e.action.kind],
                       edgecolors="black" if e.overlapped else "white", linewidth=0.5)
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
