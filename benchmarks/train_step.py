"""Train step: forward + backward + AdamW step, seekforge vs transformers DeepseekV3ForCausalLM.

Same model (the `small` preset: hidden 512, 6 layers, 16 routed experts top-4, 1 shared; MTP off,
since transformers' DeepseekV3ForCausalLM has no MTP), same weights, same batch (8 × 256 tokens
of fixed random ids), the auto dtype on both (bf16 on a CPU with native bf16 matmul, fp32 elsewhere),
fused AdamW + grad-norm clip on both. Under bf16 both compute in bf16 over fp32 master weights:
seekforge's Trainer keeps persistent bf16 copies of its matmul weights (train/master.py), transformers
runs under bf16 autocast (its documented mixed-precision recipe). seekforge runs its real
Trainer.train_step (which also does the sequence-wise aux loss and the aux-loss-free bias update);
transformers runs model(input_ids, labels) + the same optimizer.

Each contender runs in its own child process, one after another, so the peak RSS (ru_maxrss: the
child's resident-memory high-water mark, model + optimizer + activations + framework) is its own.
The contenders run in rounds (--rounds, default 3: seekforge, then each transformers path, and again):
on shared cores the speed of the machine drifts by ±10% over a minute, and a drift between two
children would read as a speed difference. Each round prints its own ratio; the summary is the
median over rounds of each contender's tokens/s and of the per-round ratios.
The bf16 matmul peak for MFU is measured in the parent just before. Wall-clock tokens/s (median
step) is the headline; CPU seconds per step (process time, all threads) is printed too because on
shared cores the wall clock mostly measures the neighbours.

    PYTHONPATH=. python benchmarks/train_step.py [--rounds 3] [--steps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from statistics import median

import torch
from machine import machine_header, parse_args  # benchmarks/machine.py

from seekforge.config import TrainConfig, preset
from seekforge.model.precision import resolve_dtype
from seekforge.train.flops import flops_per_token, measure_peak_flops

BATCH, SEQ = 8, 256
# transformers 5 selects the experts code with config._experts_implementation. "batched_mm" gathers a
# weight matrix per token copy ((N·K, 2I, H) in bf16: 4 GiB here) and was OOM-killed on this 23 GiB
# machine, so it is not run by default (--variants grouped_mm,eager,batched_mm to try it).
HF_VARIANTS = ("grouped_mm", "eager")


def model_config():
    return preset("small", num_nextn_predict_layers=0)


def fixed_batch(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


class RepeatLoader:
    """The same batch forever (state methods so the Trainer accepts it)."""

    def __init__(self, batch):
        self.batch = batch

    def __iter__(self):
        return self

    def __next__(self):
        return self.batch

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def seekforge_step_fn(dtype: str):
    from seekforge.model.model import build_model
    from seekforge.train.trainer import Trainer

    cfg = TrainConfig(preset="small", model={"num_nextn_predict_layers": 0}, seq_len=SEQ, dtype=dtype,
                      micro_batch_size=BATCH, steps=1000, mtp_loss_scale=0.0, peak_flops=1.0)
    model = build_model(model_config(), seed=0)
    trainer = Trainer(cfg, model, RepeatLoader(fixed_batch(model.cfg.vocab_size)), out_dir="/tmp/unused")
    return lambda: trainer.train_step()["loss"]


def hf_step_fn(variant: str, dtype: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from seekforge.model.model import build_model
    from seekforge.train.optim import build_optimizer

    cfg = model_config()
    hf_cfg = DeepseekV3Config(**cfg.to_hf())
    hf_cfg._experts_implementation = variant  # transformers 5: "grouped_mm" | "batched_mm" | "eager"
    model = DeepseekV3ForCausalLM(hf_cfg)
    source = build_model(cfg, seed=0).state_dict()  # identical weights: names differ by "model."
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in source.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    model.train()
    optimizer, _ = build_optimizer(model, TrainConfig(preset="small", steps=1000).optimizer_config())
    batch = fixed_batch(cfg.vocab_size)
    ids = batch["input_ids"]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=resolve_dtype(dtype)[0] == torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss  # transformers shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def child(name: str, steps: int, warmup: int, dtype: str) -> None:
    step = seekforge_step_fn(dtype) if name == "seekforge" else hf_step_fn(name.split(":", 1)[1], dtype)
    losses = [step() for _ in range(warmup)]
    times, cpu_times = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    step_s, cpu_s = median(times), median(cpu_times)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(json.dumps({"name": name, "tokens_per_s": BATCH * SEQ / step_s, "best_tokens_per_s": BATCH * SEQ / min(times),
                      "cpu_s_per_step": cpu_s, "peak_rss_mib": peak_rss_mib, "first_loss": losses[0]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3,
                   help="times every contender runs, in turn (median over rounds reported)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender and round (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default=",".join(HF_VARIANTS), help="transformers experts implementations")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = parse_args(p)
    if args.child:
        child(args.child, args.steps, args.warmup, args.dtype)
        return

    cfg = model_config()
    dtype, peak = machine_header(args.dtype, hidden_size=cfg.hidden_size)
    args.dtype = "bf16" if dtype == torch.bfloat16 else "fp32"  # both sides get the resolved dtype
    dtype_name = str(dtype).removeprefix("torch.")
    fpt = flops_per_token(cfg, SEQ, with_mtp=False)
    precision = ("fp32 master weights: seekforge bf16 weight copies, transformers autocast"
                 if dtype == torch.bfloat16 else "fp32")
    print(f"train step, preset small (MTP off), batch {BATCH}×{SEQ}, {dtype_name} ({precision}), "
          f"{args.threads} threads")
    print(f"model: {fpt / 1e6:.1f} MFLOP/token (6·activated matmul params + attention, see train/flops.py)")
    names = ["seekforge"] + [f"transformers:{v}" for v in args.variants.split(",") if v]
    rounds = []
    for index in range(args.rounds):
        results = [r for r in (run_child(name, args) for name in names) if r is not None]
        rounds.append(results)
        ratio = speedup(results)
        print(f"round {index + 1}/{args.rounds}: " + ", ".join(f"{r['name']} {r['tokens_per_s']:.0f}" for r in results)
              + " tokens/s" + (f" → {ratio['wall']:.2f}× the fastest transformers path" if ratio else ""),
              flush=True)
    # The probe runs again after the contenders and the higher value is kept: a neighbour's burst
    # during one probe would otherwise deflate the peak and inflate every MFU.
    peak = max(peak, measure_peak_flops(dtype, seconds=1.0))
    print(f"{dtype_name} matmul peak (1024³, best of a probe before and after): {peak / 1e9:.0f} GFLOP/s")
    summary = [median_result([r for results in rounds for r in results if r["name"] == name]) for name in names]
    for r in filter(None, summary):
        print(f"{r['name']:>26}: {r['tokens_per_s']:8.0f} tokens/s (median; best {r['best_tokens_per_s']:.0f}) | "
              f"CPU {r['cpu_s_per_step']:5.2f} s/step | MFU {100 * r['tokens_per_s'] * fpt / peak:5.1f}% | "
              f"peak RSS {r['peak_rss_mib']:6.0f} MiB | first loss {r['first_loss']:.4f}")
    ratios = [r for r in map(speedup, rounds) if r is not None]
    if ratios:
        walls = [r["wall"] for r in ratios]
        print(f"seekforge / fastest transformers ({ratios[0]['wall_peer']}): {median(walls):.2f}× tokens/s "
              f"(wall, median of {len(walls)} rounds: {', '.join(f'{w:.2f}' for w in walls)}); "
              f"{median([r['cpu'] for r in ratios]):.2f}× by CPU seconds per step (vs {ratios[0]['cpu_peer']}; "
              "steadier when other jobs share the cores)")

def run_child(name: str, args) -> dict | None:
    cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"{name}: failed\n{out.stderr[-2000:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def speedup(results: list[dict]) -> dict | None:
    """One round's seekforge / fastest transformers path, by wall tokens/s and by CPU seconds per step."""
    ours = next((r for r in results if r["name"] == "seekforge"), None)
    peers = [r for r in results if r["name"] != "seekforge"]
    if ours is None or not peers:
        return None
    best = max(peers, key=lambda r: r["tokens_per_s"])
    least_cpu = min(peers, key=lambda r: r["cpu_s_per_step"])
    return {"wall": ours["tokens_per_s"] / best["tokens_per_s"], "wall_peer": best["name"].split(":")[1],
            "cpu": least_cpu["cpu_s_per_step"] / ours["cpu_s_per_step"], "cpu_peer": least_cpu["name"].split(":")[1]}


def median_result(results: list[dict]) -> dict | None:
    """One contender over the rounds: median tokens/s and CPU time, best step, highest peak RSS."""
    if not results:
        return None
    return {"name": results[0]["name"], "tokens_per_s": median([r["tokens_per_s"] for r in results]),
            "best_tokens_per_s": max(r["best_tokens_per_s"] for r in results),
            "cpu_s_per_step": median([r["cpu_s_per_step"] for r in results]),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in results), "first_loss": results[0]["first_loss"]}


if __name__ == "__main__":
    main()
