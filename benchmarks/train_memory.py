"""Training-step memory: the planner's per-component prediction vs the measured peak, seekforge vs
transformers on the same batch.

    PYTHONPATH=. python benchmarks/train_memory.py [--dtype auto] [--variants grouped_mm,eager]

The default pretraining run's model and batch (TrainConfig(): the `small` preset, 8 × 256 tokens,
AdamW, auto dtype). transformers' DeepseekV3ForCausalLM has no MTP, so the comparison runs the model
with MTP off on both sides (train_step.py's setup: same weights, same batch, same optimizer); the
default run with MTP is measured too, for the planner.

Per system, in its own child process: one training step (it creates the AdamW states), then the
second step under plan/measure.LiveBytes, which counts every tensor storage alive at once (what a GPU
allocator would hold, device-independent; not timing-sensitive). Printed per run:
  predicted  seekforge.plan.memory.estimate_memory's breakdown — parameters, gradients, optimizer
             states, activations, bf16 weight copies, backward workspace — and its peak;
  measured   parameter and optimizer-state bytes (summed from the tensors themselves), the peak of
             live tensor bytes during the step, and the rest of that peak (gradients + activations +
             weight copies + workspace at the peak moment); the process's peak RSS (ru_maxrss:
             model, optimizer, activations, allocator caching and the framework itself).
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import subprocess
import sys

import torch
from machine import machine_header, parse_args  # benchmarks/machine.py
from train_step import RepeatLoader, fixed_batch, hf_step_fn

from seekforge.config import TrainConfig
from seekforge.plan.measure import LiveBytes, state_tensors
from seekforge.plan.memory import estimate_memory

MiB = 2**20
HF_VARIANTS = ("grouped_mm", "eager")


def train_config(mtp: bool, dtype: str) -> TrainConfig:
    """The default pretraining run's config; without MTP, the model transformers can run too."""
    if mtp:
        return TrainConfig(dtype=dtype, peak_flops=1.0, eval_interval=0)
    return TrainConfig(dtype=dtype, peak_flops=1.0, eval_interval=0, model={"num_nextn_predict_layers": 0},
                       mtp_loss_scale=0.0)


def seekforge_step(mtp: bool, dtype: str):
    from seekforge.model.model import build_model
    from seekforge.train.trainer import Trainer

    cfg = train_config(mtp, dtype)
    model = build_model(cfg.model_config(), seed=0)
    trainer = Trainer(cfg, model, RepeatLoader(fixed_batch(model.cfg.vocab_size)), out_dir="/tmp/unused")
    return trainer.train_step, trainer.modules, trainer.optimizers


def transformers_step(variant: str, dtype: str):
    step = hf_step_fn(variant, dtype)
    held = inspect.getclosurevars(step).nonlocals  # train_step.hf_step_fn's model and optimizer
    return step, [held["model"]], [held["optimizer"]]


def storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in tensors}.values())


def child(name: str, dtype: str) -> None:
    if name.startswith("transformers:"):
        step, modules, optimizers = transformers_step(name.split(":", 1)[1], dtype)
    else:
        step, modules, optimizers = seekforge_step(name == "seekforge+mtp", dtype)
    step()  # the first step creates the AdamW states
    params = storage_bytes(p for m in modules for p in m.parameters())
    optimizer = storage_bytes(v for o in optimizers for s in o.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor))
    tracker = LiveBytes(state_tensors(modules, optimizers))
    with tracker:
        step()
    print(json.dumps({"name": name, "params": params, "optimizer": optimizer, "peak": tracker.peak,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def predicted(mtp: bool, dtype_name: str):
    cfg = train_config(mtp, dtype_name)
    return estimate_memory(cfg.model_config(), cfg.parallel_config(), cfg.micro_batch_size, cfg.seq_len,
                           dtype=dtype_name).ranks[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(HF_VARIANTS), help="transformers experts implementations")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = parse_args(p)
    if args.child:
        child(args.child, args.dtype)
        return
    width = train_config(False, "fp32").model_config().hidden_size
    dtype, _ = machine_header(args.dtype, hidden_size=width)
    args.dtype = dtype_name = "bf16" if dtype == torch.bfloat16 else "fp32"  # every child gets the resolved dtype
    cfg = train_config(False, args.dtype)
    print(f"default pretrain config: preset {cfg.preset}, batch {cfg.micro_batch_size}×{cfg.seq_len}, {dtype_name} "
          f"({'autocast over fp32 master weights' if dtype == torch.bfloat16 else 'fp32'}), AdamW; "
          f"peak live tensor bytes of the 2nd step")
    results = {}
    for name in ["seekforge", "seekforge+mtp"] + [f"transformers:{v}" for v in args.variants.split(",") if v]:
        out = subprocess.run([sys.executable, __file__, "--child", name, "--threads", str(args.threads),
                              "--dtype", dtype_name], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr[-2000:]}")
            continue
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])

    for name, mtp in (("seekforge", False), ("seekforge+mtp", True)):
        plan, got = predicted(mtp, dtype_name), results.get(name)
        print(f"\n{name} ({'MTP on: the default run' if mtp else 'MTP off: the model transformers runs'}) — "
              f"predicted by plan/memory.estimate_memory (peak at {plan.peak_phase}):")
        for label, value in plan.rows():
            print(f"  {label:<20}{value / MiB:9.1f} MiB")
        if got:
            rest = got["peak"] - got["params"] - got["optimizer"]
            predicted_rest = plan.peak - plan.params - plan.optimizer
            print(f"  measured: parameters {got['params'] / MiB:.1f} MiB, optimizer states {got['optimizer'] / MiB:.1f}"
                  f" MiB, rest of the peak (grads + activations + copies + workspace) {rest / MiB:.1f} MiB "
                  f"(predicted {predicted_rest / MiB:.1f})")
            print(f"  measured peak live bytes {got['peak'] / MiB:.1f} MiB, predicted {plan.peak / MiB:.1f} MiB "
                  f"({plan.peak / got['peak'] - 1:+.1%}); peak RSS {got['peak_rss_mib']:.0f} MiB")

    print("\nsame model (MTP off), same batch:")
    for name, got in results.items():
        if name != "seekforge+mtp":
            rest = got["peak"] - got["params"] - got["optimizer"]
            print(f"{name:>26}: peak live {got['peak'] / MiB:8.1f} MiB | parameters {got['params'] / MiB:6.1f} | "
                  f"optimizer {got['optimizer'] / MiB:6.1f} | rest {rest / MiB:7.1f} | "
                  f"peak RSS {got['peak_rss_mib']:6.0f} MiB")
    ours = results.get("seekforge")
    peers = [r for n, r in results.items() if n.startswith("transformers")]
    if ours and peers:
        least = min(peers, key=lambda r: r["peak"])
        least_rss = min(peers, key=lambda r: r["peak_rss_mib"])
        print(f"seekforge / lowest transformers: peak live bytes {ours['peak'] / least['peak']:.2f}× "
              f"(vs {least['name'].split(':')[1]}), peak RSS {ours['peak_rss_mib'] / least_rss['peak_rss_mib']:.2f}× "
              f"(vs {least_rss['name'].split(':')[1]}); ≤ 1.00 meets the target")


if __name__ == "__main__":
    main()
