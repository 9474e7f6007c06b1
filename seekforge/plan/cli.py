"""`seekforge plan memory|schedule|balance|search`: planning from configs, no hardware needed.

    seekforge plan memory --preset small --parallel dp_shard=2 --micro-batch-size 8 --seq-len 256
    seekforge plan schedule --schedule ZBVZeroBubble --pp 4 --microbatches 8 --png zbv.png
    seekforge plan balance --preset v3-671b --pp 16
    seekforge plan search --preset v3-671b --devices 2048 --device-memory 80GB
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

from seekforge.config import (
    CONFIG_HELP,
    PIPELINE_SCHEDULES,
    PRESETS,
    ModelConfig,
    ParallelConfig,
    model_config_of,
    parse_bytes,
    parse_parallel,
    preset,
)

GiB = 2**30


def add_arguments(p):
    sub = p.add_subparsers(dest="what", required=True, metavar="{memory,schedule,balance,search}",
                           parser_class=functools.partial(argparse.ArgumentParser,
                                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    memory = sub.add_parser("memory", help="peak memory per rank class of one training step")
    _model_args(memory)
    memory.add_argument("--parallel", default="", metavar="KEY=VALUE,...", help="ParallelConfig keys, as pretrain")
    memory.add_argument("--micro-batch-size", type=int, default=1,
                        help="sequences per data-parallel rank per step (pretrain's --micro-batch-size is the global "
                             "batch: divide it by dp_replicate·dp_shard)")
    memory.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="compute: bf16 autocast over fp32 master weights (pretrain's bf16), or fp32")
    memory.add_argument("--optimizer-dtype", choices=("fp32", "bf16"), default="fp32", help="AdamW moments")
    memory.add_argument("--moe-skew", type=_skews, default=1.0, metavar="SKEW[,SKEW,...]",
                        help="busiest expert-parallel rank's routed tokens over the mean (every EP rank planned "
                             "as it), or one value per EP rank, comma-separated (one row each), e.g. 1.3,0.7")
    memory.add_argument("--flash-attention", action="store_true",
                        help="count the CUDA SDPA path (no T x T probabilities kept) instead of the CPU one")
    memory.add_argument("--traced", action="store_true",
                        help="also run the real step on fake tensors (one device or FSDP layouts; CPU path)")

    schedule = sub.add_parser("schedule", help="simulate a pipeline schedule")
    schedule.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B, Interleaved1F1B, ZB-H1, "
                          "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")
    schedule.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    schedule.add_argument("--microbatches", type=int, default=8,
                          help="micro-batches per step: at least --pp (DualPipeV: 2 x pp), as pretrain wants")
    schedule.add_argument("--forward", type=float, default=1.0, help="F time per stage")
    schedule.add_argument("--backward-input", type=float, default=1.0, help="B (input gradient) time per stage")
    schedule.add_argument("--backward-weight", type=float, default=1.0, help="W (weight gradient) time per stage")
    schedule.add_argument("--recompute", type=float, default=0.0, help="recompute time added before B")
    schedule.add_argument("--fandb", type=float, help="DualPipeV: time of one overlapped F&B unit (a forward "
                          "and a full backward, DeepSeek's F&B); default F + B, the two run one after the other "
                          "as torch runs them")
    schedule.add_argument("--p2p-latency", type=float, default=0.0,
                          help="time of one send between pipeline ranks, in the unit of --forward")
    schedule.add_argument("--png", help="write the timeline picture here")

    balance = sub.add_parser("balance", help="layers and recompute per pipeline stage (SAPP-style)")
    _model_args(balance)
    balance.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    balance.add_argument("--schedule", default="1F1B", help="pipeline schedule (ParallelConfig.pp_schedule): "
                         + ", ".join(PIPELINE_SCHEDULES))
    balance.add_argument("--microbatches", type=int, help="pipeline micro-batches per step; none given: 2 x pp")
    balance.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    balance.add_argument("--parallel", default="", metavar="KEY=VALUE,...",
                         help="the other dimensions (dp_shard, ep, tp)")
    balance.add_argument("--device-memory", default="80GB", help="memory per device, e.g. 80GB or 141GiB")
    balance.add_argument("--flops", type=float, default=400e12, help="achievable FLOP/s per device")

    search = sub.add_parser("search", help="rank parallel layouts for a cluster")
    _model_args(search)
    search.add_argument("--devices", type=int, required=True, help="devices in the cluster (the world size)")
    search.add_argument("--device-memory", default="80GB", help="memory per device, e.g. 80GB or 141GiB")
    search.add_argument("--devices-per-node", type=int, default=8,
                        help="devices sharing a node's fast links (tp stays within a node)")
    search.add_argument("--flops", type=float, default=400e12, help="achievable FLOP/s per device")
    search.add_argument("--intra-node-bandwidth", type=float, default=150e9,
                        help="bytes/s per device within a node (NVLink)")
    search.add_argument("--inter-node-bandwidth", type=float, default=50e9,
                        help="bytes/s per device between nodes (InfiniBand)")
    search.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    search.add_argument("--top", type=int, default=10, help="how many of the fastest layouts to print")


def _model_args(p):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="v3-671b", help="model preset")
    src.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")


def _model(args) -> ModelConfig:
    return model_config_of(args.config) if args.config else preset(args.preset)


def _layout(spec: str, cfg: ModelConfig, **overrides) -> ParallelConfig:
    """The --parallel layout (overrides win), checked as pretrain checks it (ParallelConfig.validate): what
    plan accepts, pretrain runs."""
    pc = ParallelConfig.from_table({**(parse_parallel(spec) if spec else {}), **overrides})
    pc.validate(pc.world_size, cfg)
    return pc


def _skews(text: str) -> float | list[float]:
    """--moe-skew: one number, or one per EP rank ("1.3,0.7"); estimate_memory checks the count."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number (e.g. 1.2) or one per EP rank, comma-separated "
                                         "(e.g. 1.3,0.7)") from None
    return values[0] if len(values) == 1 else values


# (flags, the test a value must pass, the fix): counts are at least 1, as TrainConfig and ParallelConfig want
# theirs; a FLOP rate or bandwidth divides a time, so it is above 0.
_BOUNDS = (
    (("pp", "microbatches", "micro_batch_size", "seq_len", "devices", "devices_per_node", "global_batch", "top"),
     lambda v: v >= 1, "give at least 1"),
    (("moe_skew",), lambda v: math.isfinite(v) and v >= 1 if isinstance(v, float)
     else all(math.isfinite(x) and x >= 0 for x in v),
     "give at least 1 (the busiest expert-parallel rank's routed tokens over the mean), or one value >= 0 per "
     "expert-parallel rank"),
    (("flops", "intra_node_bandwidth", "inter_node_bandwidth"), lambda v: math.isfinite(v) and v > 0,
     "give a rate > 0"),
    (("forward", "backward_input", "backward_weight", "recompute", "p2p_latency"),
     lambda v: math.isfinite(v) and v >= 0, "give a time >= 0"),
)


def _check_numbers(args) -> None:
    given = vars(args)
    for keys, ok, fix in _BOUNDS:
        for key in keys:
            if given.get(key) is not None and not ok(given[key]):
                raise ValueError(f"--{key.replace('_', '-')} {given[key]}: {fix}")


def run(args):
    _check_numbers(args)
    {"memory": _memory, "schedule": _schedule, "balance": _balance, "search": _search}[args.what](args)


def _memory(args):
    from seekforge.plan.memory import estimate_memory, format_plan

    cfg = _model(args)
    pc = _layout(args.parallel, cfg)
    plan = estimate_memory(cfg, pc, args.micro_batch_size, args.seq_len, args.dtype,
                           4 if args.optimizer_dtype == "fp32" else 2, args.moe_skew,
                           flash_attention=args.flash_attention)
    print(f"{pc.world_size} ranks, {args.micro_batch_size} x {args.seq_len} tokens per data-parallel rank, "
          f"{args.dtype}, recompute={pc.recompute}" + (f"; cp={pc.cp}: each rank holds {args.seq_len // pc.cp} "
                                                       "tokens of every sequence" if pc.cp > 1 else ""))
    print(format_plan(plan))
    print(f"peak {plan.peak / GiB:.2f} GiB")
    if args.traced:
        from seekforge.plan.traced import traced_peak

        traced = traced_peak(cfg, args.micro_batch_size, args.seq_len, args.dtype, pc.recompute, pc=pc)
        print(f"traced (the real step on fake tensors, rank 0): peak {traced / GiB:.2f} GiB")


def _schedule(args):
    from seekforge.plan import schedule as sched

    if args.schedule in sched.SIMULATED_SCHEDULES:  # an unknown one: simulate names the known
        # pretrain's own checks of pp and microbatches (ParallelConfig); ZB-H1, simulated but not run, keeps
        # one stage per rank as 1F1B does and takes 1F1B's checks
        ParallelConfig(pp=args.pp, microbatches=args.microbatches,
                       pp_schedule="1F1B" if args.schedule == "ZB-H1" else args.schedule)
    costs = sched.uniform_costs(args.schedule, args.pp, args.forward, args.backward_input, args.backward_weight,
                                args.recompute)
    overlap = 0.0
    if args.fandb is not None:
        if args.schedule != "DualPipeV":
            raise ValueError(f"--fandb times DualPipeV's overlapped F&B units; {args.schedule} has none: drop it")
        f, b = args.forward, args.recompute + args.backward_input + args.backward_weight
        if not max(f, b) <= args.fandb <= f + b:
            raise ValueError(f"--fandb {args.fandb} must lie between max(F, B) = {max(f, b)} and F + B = {f + b}")
        overlap = f + b - args.fandb  # the time the overlap hides
    result = sched.simulate(args.schedule, costs, args.microbatches, args.p2p_latency, overlap)
    print(f"{args.schedule}: {args.pp} ranks, {len(costs)} stages, {args.microbatches} micro-batches")
    print(f"step time {result.step_time:.4g}, bubble {result.bubble_time:.4g} ({result.bubble_ratio:.1%} of a "
          f"rank's compute)")
    print("peak in-flight micro-batches per stage: " + " ".join(map(str, result.peak_inflight)))
    if args.png:
        sched.draw_timeline(result, args.png)
        print(f"timeline written to {args.png}")


def _balance(args):
    from seekforge.plan.balance import MODES, analytic_costs, even_split, inflight_per_stage, simulated_step

    cfg = _model(args)
    microbatches = args.microbatches or 2 * args.pp
    pc = _layout(args.parallel, cfg, pp=args.pp, pp_schedule=args.schedule, microbatches=microbatches,
                 mixed_precision="bf16")
    device = parse_bytes(args.device_memory)
    limit = device / pc.stages_per_rank
    costs = analytic_costs(cfg, pc, args.micro_batch_size, args.seq_len, args.flops)
    inflight = inflight_per_stage(pc)
    best, check, limit = _fitting_balance(cfg, pc, costs, inflight, limit, device, args.micro_batch_size,
                                          args.seq_len)
    evens = [e for e in (even_split(costs, pc.num_stages, microbatches, m, inflight) for m in MODES)
             if max(e.stage_memory) <= limit]
    print(f"{cfg.num_hidden_layers} layers over {pc.num_stages} stages ({pc.pp_schedule}), {microbatches} "
          f"micro-batches of {args.micro_batch_size} x {args.seq_len}, {limit / GiB:.1f} GiB per stage for state and "
          "in-flight activations")
    print(f"{'stage':>5} {'layers':>9} {'recompute':>10} {'time s':>9} {'memory GiB':>11}")
    bounds = [0, *best.split_points, cfg.num_hidden_layers]
    for s in range(pc.num_stages):
        print(f"{s:>5} {f'{bounds[s]}-{bounds[s + 1] - 1}':>9} {best.recompute[s]:>10} {best.stage_times[s]:>9.4f} "
              f"{best.stage_memory[s] / GiB:>11.2f}")
    sim = simulated_step(costs, best, args.schedule, args.pp, microbatches)
    print(f"step (1F1B model) {best.step_time:.3f} s, simulated {args.schedule} {sim:.3f} s")
    if evens:
        even = min(evens, key=lambda e: e.step_time)
        even_sim = simulated_step(costs, even, args.schedule, args.pp, microbatches)
        print(f"even split with recompute={even.recompute[0]}: {even.step_time:.3f} s (simulated {even_sim:.3f} s); "
              f"balanced: step time {sim / even_sim - 1:+.1%}, tokens/s x{even_sim / sim:.2f}")
    else:
        print("no even split fits, whatever the recompute mode")
    print(f"dry run of this layout (plan memory): peak {check.peak / GiB:.1f} GiB per rank, "
          f"{1 - check.peak / device:+.1%} headroom under {device / GiB:.1f} GiB")
    # pretrain's --micro-batch-size is the global batch: per data-parallel rank, `microbatches` of these
    global_batch = args.micro_batch_size * microbatches * pc.dp_replicate * pc.dp_shard
    print(f"pretrain flags: --seq-len {args.seq_len} --micro-batch-size {global_batch} "
          f"--parallel {best.parallel_arg(cfg, pc)}")


def _fitting_balance(cfg, pc, costs, inflight, limit, device, micro_batch_size, seq_len, tries=3):
    """balance_stages under `limit` per stage, checked by the full dry run (plan memory) of its layout.

    The balancer's stage memory is state + in-flight activations; the dry run adds the backward's
    transients and FSDP's gathered weights (DeepSeek-V3-671B on 16 stages: 12 GiB over the balancer's
    73.4). While the dry run exceeds the device memory, the limit drops by the excess and the stages are
    balanced again. Returns (balance, dry run, the limit used)."""
    from seekforge.plan.balance import balance_stages
    from seekforge.plan.memory import estimate_memory

    for attempt in range(tries):
        best = balance_stages(costs, pc.num_stages, pc.microbatches, limit, inflight)
        layout = dataclasses.replace(pc, pp_split_points=best.split_points, recompute=best.layer_modes(cfg))
        check = estimate_memory(cfg, layout, micro_batch_size * pc.microbatches, seq_len, flash_attention=True)
        if check.peak <= device or attempt == tries - 1:
            return best, check, limit
        limit -= (check.peak - device) / pc.stages_per_rank


def _search(args):
    from seekforge.plan.search import Cluster, search, why_nothing_fits

    cfg = _model(args)
    cluster = Cluster(args.devices, parse_bytes(args.device_memory), args.flops, args.devices_per_node,
                      args.intra_node_bandwidth, args.inter_node_bandwidth)
    result = search(cfg, cluster, args.global_batch, args.seq_len, top=args.top)
    if not result.plans:
        raise ValueError(why_nothing_fits(result, cluster))
    print(f"{result.considered} layouts considered for {args.devices} devices x {args.device_memory}; "
          f"global batch {args.global_batch} x {args.seq_len} tokens")
    print(f"{'#':>2} {'tokens/s':>11} {'step s':>7} {'peak GiB':>9} {'bubble':>7} {'mbs':>4}  --parallel")
    for i, p in enumerate(result.plans, 1):
        print(f"{i:>2} {p.tokens_per_second:>11,.0f} {p.step_time:>7.2f} {p.peak_memory / GiB:>9.1f} "
              f"{p.bubble_ratio:>7.1%} {p.micro_batch_size:>4}  {p.parallel_arg()}")
