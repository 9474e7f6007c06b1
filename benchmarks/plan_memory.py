"""`seekforge plan memory` against a measurement: the predicted peak of live tensor bytes per rank vs
the peak measured during a real training step (train/trainer.Trainer: bf16 over fp32 master weights,
train/master.py, on one process, autocast or FSDP2's policy on several; AdamW, chunked cross-entropy;
pipeline stages through PipelineRunner), on one process and on gloo ranks.

    python benchmarks/plan_memory.py [--cases single-dense,fsdp2-moe] [--threads 1] [--repeats 3]

The second training step is measured (the first creates the AdamW states). The reference is the
profiler's allocation record (plan/measure.ProfilerLiveBytes: every allocation and free from before
the model is built; the peak of what is live during the step); LiveBytes (the dispatch-mode count the
tests use) and, on one device and FSDP layouts, the traced mode's peak (plan/traced.py: the same step
on fake tensors) are compared with it too. Under expert parallelism the plan is made at balanced
routing (its bound when routing is unknown) and again at each EP rank's measured received copies over
the mean ("EP skew", "routed").
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seekforge.config import ParallelConfig, TrainConfig  # noqa: E402
from seekforge.plan.memory import MemoryPlan, estimate_memory  # noqa: E402
from seekforge.plan.traced import traced_peak  # noqa: E402


@dataclass
class Case:
    name: str
    model: dict
    parallel: dict = field(default_factory=dict)
    recompute: str = "none"
    micro_batch_size: int = 8  # per data-parallel rank (the whole pipeline batch under pp)
    seq_len: int = 256
    dtype: str = "bf16"


SMALL4 = dict(num_hidden_layers=4)  # small preset: 1 dense + 3 MoE layers, MTP
# Issue 44's config, which no test uses: no q_lora, narrower, fewer experts, 1 dense + 2 MoE layers, MTP.
ISSUE44 = dict(num_hidden_layers=3, hidden_size=320, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=96,
               q_lora_rank=None)
I44 = dict(seq_len=384, micro_batch_size=3)
CASES = [
    Case("single-dense", dict(num_hidden_layers=4, n_routed_experts=0, first_k_dense_replace=4)),
    Case("single-moe", SMALL4),
    Case("single-moe-full", SMALL4, recompute="full"),
    Case("single-moe-selective", SMALL4, recompute="selective"),
    Case("single-moe-fp32", SMALL4, dtype="fp32", micro_batch_size=4),
    Case("fsdp2-moe", SMALL4, dict(dp_shard=2), micro_batch_size=4),
    Case("fsdp2-ep2-moe-full", SMALL4, dict(dp_shard=2, ep=2), recompute="full", micro_batch_size=4),
    Case("pp2-1f1b", SMALL4, dict(pp=2, pp_schedule="1F1B", microbatches=4)),
    Case("pp2-zbv", SMALL4, dict(pp=2, pp_schedule="ZBVZeroBubble", microbatches=4)),
    Case("i44-bf16", ISSUE44, **I44),
    Case("i44-bf16-full", ISSUE44, recompute="full", **I44),
    Case("i44-bf16-selective", ISSUE44, recompute="selective", **I44),
    Case("i44-fp32", ISSUE44, dtype="fp32", **I44),
    Case("i44-fsdp2-ep2-fp32", ISSUE44, dict(dp_shard=2, ep=2), dtype="fp32", **I44),
    Case("i44-pp2-1f1b", ISSUE44, dict(pp=2, pp_schedule="1F1B", microbatches=3), **I44),
    # context parallelism (ring attention): its cp ranks share the 3 rows
    Case("i44-cp2-fp32", ISSUE44, dict(cp=2), dtype="fp32", **I44),
    Case("i44-cp2-fsdp2-fp32", ISSUE44, dict(cp=2, dp_shard=2), dtype="fp32", **I44),
    Case("i44-cp2-bf16", ISSUE44, dict(cp=2, mixed_precision="bf16"), **I44),
    Case("i44-cp2-autocast", ISSUE44, dict(cp=2), **I44),  # bf16 autocast on plain weights: master weights
    Case("i44-cp2-tp2-fp32", ISSUE44, dict(cp=2, tp=2), dtype="fp32", **I44),
    Case("i44-cp2-pp2-fp32", ISSUE44, dict(cp=2, pp=2, pp_schedule="1F1B", microbatches=3), dtype="fp32", **I44),
    Case("i44-cp2-ep2-bf16", ISSUE44, dict(cp=2, ep=2, mixed_precision="bf16"), **I44),
    Case("i44-etp2-ep2", ISSUE44, dict(dp_shard=4, ep=2, etp=2), **I44),
    Case("i44-ep4-nodes2", ISSUE44, dict(dp_shard=4, ep=4, ep_nodes=2), **I44),
]


def train_config(case: Case) -> TrainConfig:
    return TrainConfig(preset="small", model=case.model, seq_len=case.seq_len, micro_batch_size=case.micro_batch_size,
                       recompute=case.recompute, dtype=case.dtype, peak_flops=1.0, eval_interval=0,
                       parallel=case.parallel, out_dir=tempfile.gettempdir())


def measure_rank(case: Case, mesh=None) -> dict:
    """Build, train one step, then measure the second step on this rank: "profiler", the peak live
    bytes of the profiler's allocation record (started before the model is built); "live", LiveBytes'
    peak; "skew", the routed copies this rank's experts received over the mean (expert parallelism)."""
    from seekforge.plan.measure import ProfilerLiveBytes

    with ProfilerLiveBytes() as reference:
        live, skew = _train_and_measure(case, mesh, reference)
    return {"profiler": reference.peak, "live": live, "skew": skew}


def _train_and_measure(case: Case, mesh, reference) -> tuple[int, float]:
    from seekforge.model.model import build_model
    from seekforge.parallel.parallelize import parallelize
    from seekforge.parallel.pp import PipelineRunner
    from seekforge.plan.measure import LiveBytes, state_tensors
    from seekforge.train.trainer import Trainer, prepare_model

    cfg = train_config(case)
    model = build_model(cfg.model_config(), seed=0)
    pc = cfg.parallel_config()
    if mesh is None:
        model = prepare_model(model, cfg)
    elif pc.pp > 1:
        model = PipelineRunner(model, pc, mesh, cfg.mtp_loss_scale, torch.bfloat16 if case.dtype == "bf16" else None)
    else:
        model = parallelize(model, pc, mesh)
    gen = torch.Generator().manual_seed(0)
    vocab = cfg.model_config().vocab_size

    def loader():
        while True:
            tokens = torch.randint(0, vocab, (case.micro_batch_size, case.seq_len + 1), generator=gen)
            yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    trainer = Trainer(cfg, model, loader(), mesh=mesh)  # under cp the Trainer forwards this rank's chunks
    trainer.train_step()
    tracker = LiveBytes(state_tensors(trainer.modules, trainer.optimizers, trainer.master_weights))
    with reference.window(), tracker, _routed_copies(trainer) as copies:
        trainer.train_step()
    return tracker.peak, copies[0] / copies[1] if copies[1] else 1.0


@contextmanager
def _routed_copies(trainer):
    """Yields [copies received, copies sent] by this rank's expert-parallel dispatches (summed over MoE
    layers), counted while the block runs (flat or hierarchical; under expert-TP its own copies, before
    the etp ranks gather theirs)."""
    from seekforge.parallel.ep import AllToAllDispatcher, HierarchicalDispatcher

    counts = [0, 0]
    originals = {cls: cls.dispatch for cls in (AllToAllDispatcher, HierarchicalDispatcher)}

    def counting(original):
        def dispatch(self, x, indices, num_experts):
            received, per_expert, state = original(self, x, indices, num_experts)
            counts[0] += int(per_expert.sum())
            counts[1] += indices.numel()
            return received, per_expert, state
        return dispatch

    for cls, original in originals.items():
        cls.dispatch = counting(original)
    try:
        yield counts
    finally:
        for cls, original in originals.items():
            cls.dispatch = original


def _rank_main(rank: int, world: int, tmp: str, case: Case, out: dict) -> None:
    from seekforge.parallel.mesh import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    cfg = train_config(case)
    mesh = build_mesh(cfg.parallel_config(), cfg.model_config())
    out[rank] = measure_rank(case, mesh)
    dist.barrier()
    dist.destroy_process_group()


def measure(case: Case, repeats: int = 1) -> list[dict]:
    """Per rank, measure_rank's numbers; on gloo ranks the median of `repeats` runs of each (gloo copies
    in-flight reduce-scatter inputs on its worker threads, so the profiler's peak under FSDP varies with
    how far those threads lag: with the machine's load)."""
    pc = ParallelConfig(**case.parallel)
    if pc.world_size == 1:
        return [measure_rank(case)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank_main, args=(pc.world_size, tmp, case, out), nprocs=pc.world_size, join=True)
            runs.append([out[r] for r in range(pc.world_size)])
    return [{key: statistics.median(run[r][key] for run in runs) for key in runs[0][r]} for r in range(pc.world_size)]


def predict(case: Case, moe_skew: float | list[float] = 1.0) -> MemoryPlan:
    """The plan at balanced routing (every EP rank receiving the mean), or at per-EP-rank skews."""
    cfg = train_config(case)
    return estimate_memory(cfg.model_config(), cfg.parallel_config(), case.micro_batch_size, case.seq_len,
                           dtype=case.dtype, moe_skew=moe_skew)


def ep_skews(case: Case, measured: list[dict]) -> list[float] | None:
    """Each EP rank's received copies over the mean, from the ranks' measurements (None without EP)."""
    pc = train_config(case).parallel_config()
    if pc.ep == 1:
        return None
    return [measured[e * pc.tp]["skew"] for e in range(pc.ep)]  # global ranks 0..ep·tp-1: the first EP group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each gloo case; the median per rank")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chosen = [c for c in CASES if c.name in args.cases.split(",")]
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, small preset; "
          f"peak live MiB of the 2nd training step, per rank (r0/r1/...; gloo ranks: median of {args.repeats} "
          "runs); "
          "errors against the profiler's allocation record")
    print(f"{'case':<21}{'predicted':>24}{'profiler':>24}{'error':>26}{'LiveBytes err':>26}{'traced err':>11}"
          f"{'EP skew':>20}{'routed err':>26}")
    worst = 0.0
    for case in chosen:
        plan = predict(case)
        traced = None
        pc = train_config(case).parallel_config()
        if pc.ep == pc.pp == pc.tp == pc.cp == 1:  # the traced mode covers one device and FSDP/HSDP
            cfg = train_config(case)
            traced = traced_peak(cfg.model_config(), case.micro_batch_size, case.seq_len, case.dtype, case.recompute,
                                 pc=pc)
        measured = measure(case, args.repeats)
        skews = ep_skews(case, measured)
        routed = predict(case, skews) if skews else None
        refs = [m["profiler"] for m in measured]
        predicted = [plan.rank_peak(rank) for rank in range(len(measured))]
        errors = [p / r - 1 for p, r in zip(predicted, refs, strict=True)]
        worst = max([worst, *map(abs, errors)])

        def joined(values, fmt):
            return "/".join(format(v, fmt) for v in values)

        row = (f"{case.name:<21}{joined([p / 2**20 for p in predicted], '.1f'):>24}"
               f"{joined([r / 2**20 for r in refs], '.1f'):>24}{joined(errors, '+.1%'):>26}"
               f"{joined([m['live'] / r - 1 for m, r in zip(measured, refs, strict=True)], '+.1%'):>26}")
        row += f"{traced / refs[0] - 1:>+11.1%}" if traced is not None else f"{'-':>11}"
        if routed is not None:
            at = [routed.rank_peak(rank) / r - 1 for rank, r in enumerate(refs)]
            row += f"{joined([m['skew'] for m in measured], '.2f'):>20}{joined(at, '+.1%'):>26}"
        print(row, flush=True)
    print(f"largest |error| of the analytic estimate {worst:.1%}")


if __name__ == "__main__":
    main()
