"""The GPU suite: one script, one table, under 8 minutes on one H200.

    PYTHONPATH=. python benchmarks/gpu/run.py --check     # every fast path equals its reference, on the GPU (< 3 min)
    PYTHONPATH=. python benchmarks/gpu/run.py             # the table (needs a CUDA GPU)
    PYTHONPATH=. python benchmarks/gpu/run.py --dry-run [--check]   # tiny shapes, the GPU path on the CPU (tests)
    bash benchmarks/gpu/device.sh                         # on a lent GPU machine: checks, then the suite, to $OUT

Rows (bf16 on the GPU; the dry run uses the CPU's auto dtype):
  train step     seekforge's Trainer.train_step (AdamW, bf16 over fp32 master weights) on a ~1B-parameter
                 DeepSeek-V3-shaped model (MLA with kv_lora_rank 512 + rope 64, 16 routed experts top-4 + 1
                 shared, MTP), eager and with each block torch.compile'd (TrainConfig.compile): tokens/s, MFU
                 against the bf16 matmul peak measured on this device in the same run, peak memory.
  decode         batch-1 ms/token: seekforge's engine (LLM) with CUDA graphs and without, vs transformers
                 `generate`, same weights (logits checked equal in fp32 first), greedy.
  throughput     N requests × (prompt + new tokens), continuous batching vs one `generate` batch.
  prefix cache   N requests sharing a long prefix, prefix caching on vs off.
  speculative    batch-1 decode with MTP speculative decoding (EngineConfig.speculative_tokens=1) vs
                 without, its acceptance rate, and whether the greedy output is unchanged.
Every row also shows, per step (a train step, a decoded token, a throughput run's engine step): kernel
launches (CUDA runtime launch calls seen by the profiler; a CUDA graph replay is one; on the CPU the aten
ops dispatched instead), host syncs (seekforge.model.gpu.sync.HostSyncGuard: values read back to the
host), and the GPU busy fraction (the profiled kernels' time over the unprofiled wall time of a step).
--check (check.py) runs instead of the rows: Triton kernels vs their torch references at the suite's
shapes, the engine vs transformers greedy in fp32 with graphs and without, and a train step's loss and
gradients on the GPU path vs the CPU's, with no host sync in it. The project never depends on a GPU:
without one, only --dry-run runs (the GPU path forced onto CPU tensors, Triton interpreted, for --check).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # Triton interprets our kernels on CPU tensors: set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: machine, train_step, serve_throughput
from common import DRY, GPU, Shapes, Timer, step_cost  # noqa: E402
from machine import machine_header  # noqa: E402
from serve_throughput import hf_generate, hf_peer  # noqa: E402
from train_step import RepeatLoader  # noqa: E402

from seekforge.config import ModelConfig, TrainConfig  # noqa: E402
from seekforge.model.gpu import forced_gpu_path  # noqa: E402
from seekforge.model.model import build_model  # noqa: E402
from seekforge.model.tokenizer import load_tokenizer  # noqa: E402
from seekforge.serve.engine import LLM  # noqa: E402
from seekforge.serve.sequence import SamplingParams  # noqa: E402
from seekforge.train.flops import flops_per_token, measure_peak_flops  # noqa: E402


def train_row(cfg: ModelConfig, s: Shapes, device: torch.device, dtype: str, timer: Timer, compiled: bool) -> tuple:
    from seekforge.train.trainer import Trainer

    tcfg = TrainConfig(preset="small", model=s.model, seq_len=s.seq, dtype=dtype, micro_batch_size=s.batch,
                       steps=1000, peak_flops=1.0, eval_interval=0, log_interval=0, compile=compiled)
    model = build_model(cfg, device=device, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (s.batch, s.seq + 1), generator=gen)
    trainer = Trainer(tcfg, model, RepeatLoader({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}),
                      out_dir="/tmp/unused")
    for _ in range(3 if compiled else 2):  # warm-up: AdamW states, kernels picked, blocks compiled
        trainer.train_step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [timer(trainer.train_step)[1] for _ in range(s.steps)]
    median = sorted(times)[len(times) // 2]
    cost = step_cost(trainer.train_step, 1, median, device)
    peak = measure_peak_flops(trainer.compute_dtype, device, size=8192 if device.type == "cuda" else 1024)
    tokens_per_s = s.batch * s.seq / median
    mfu = tokens_per_s * trainer.flops_per_token / peak
    memory = f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB, " if device.type == "cuda" else ""
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return shown("train step" + (" (compiled)" if compiled else ""), f"{tokens_per_s:,.0f} tok/s, MFU {100 * mfu:.1f}%",
            "—", "—", *cost.cells(), f"{s.batch}×{s.seq}, {memory}peak {peak / 1e9:,.0f} GFLOP/s measured")


def shown(*row: str) -> tuple:
    """A finished row, printed at once (a run stopped by its time limit still shows the rows it measured)."""
    print("[row] " + " | ".join(row), flush=True)
    return row


def serving_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """The model in `dtype` on `device` (routers fp32, as build_model keeps them), and transformers' copy."""
    source = build_model(cfg, seed=0).eval()  # fp32 on the CPU: the peer's logits are checked here
    hf = hf_peer(source).to(device=device, dtype=dtype)
    model = source.to(device=device, dtype=dtype)
    for m in model.moe_layers():
        m.gate.float()
    model.init_buffers()
    return model, hf


def decode_rows(llms: dict, hf, prompts, s: Shapes, device: torch.device, timer: Timer) -> list[tuple]:
    """Batch-1 ms/token of each engine in `llms` (name → LLM) vs transformers, and throughput with the first."""
    new, one, rows = s.new, prompts[:1], []
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

    def per_token_ms(run_one, run_all):  # best of 3; the difference removes prefill and the first token
        return min(1000 * (timer(run_all)[1] - timer(run_one)[1]) / (new - 1) for _ in range(3))

    hf_ms = per_token_ms(lambda: hf_generate(hf, one.to(device), 1), lambda: hf_generate(hf, one.to(device), new))
    ms = {}
    for name, llm in llms.items():
        ms[name] = per_token_ms(lambda llm=llm: llm.generate(one.tolist(), first),
                                lambda llm=llm: llm.generate(one.tolist(), decode))
        cost = step_cost(lambda llm=llm: llm.generate(one.tolist(), decode), new, ms[name] / 1000, device)
        rows.append(shown(f"decode batch-1 ({name})", f"{ms[name]:.2f} ms/token", f"{hf_ms:.2f} ms/token",
                          f"{hf_ms / ms[name]:.2f}×", *cost.cells(),
                          f"{new} new tokens after {s.prompt}; lower is better"))
    llm = next(iter(llms.values()))
    n = s.requests
    outs, t_sf = timer(lambda: llm.generate(prompts.tolist(), decode))
    hf_out, t_hf = timer(lambda: hf_generate(hf, prompts.to(device), new))
    same = sum(o.outputs[0].token_ids == h.tolist() for o, h in zip(outs, hf_out, strict=True))
    # the cost of a step from a shorter run of the same requests: one prefill step, then a decode step per token
    short = SamplingParams(temperature=0, max_tokens=min(new, 32), ignore_eos=True)
    cost = step_cost(lambda: llm.generate(prompts.tolist(), short), short.max_tokens + 1, t_sf / (new + 1), device)
    rows.append(shown("throughput", f"{n * new / t_sf:,.0f} new tok/s", f"{n * new / t_hf:,.0f} new tok/s",
                      f"{t_hf / t_sf:.2f}×", *cost.cells(), f"{n} × ({s.prompt} + {new}); greedy identical {same}/{n}"))
    return rows, ms[next(iter(llms))]


def serve_rows(cfg: ModelConfig, s: Shapes, device: torch.device, dtype: torch.dtype, timer: Timer) -> list[tuple]:
    model, hf = serving_model(cfg, device, dtype)
    tok = load_tokenizer("byte")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (s.requests, s.prompt), generator=gen)
    llms = {"graphs": LLM(model, tok, **s.engine),
            "eager": LLM(model, tok, **s.engine, cuda_graphs=False)}
    for llm in llms.values():
        llm.generate(prompts[:2].tolist(), SamplingParams(temperature=0, max_tokens=4))  # warm-up
    hf_generate(hf, prompts[:2, :16].to(device), 2)
    rows, sf_ms = decode_rows(llms, hf, prompts, s, device, timer)
    del llms["eager"], hf  # frees the peer and the second cache before the prefix workload
    rows.append(prefix_row(model, tok, s, device, timer, gen))
    rows.append(speculative_row(model, tok, s, device, timer, prompts[:1], sf_ms))
    return rows


def prefix_row(model, tok, s: Shapes, device: torch.device, timer: Timer, gen) -> tuple:
    n = s.requests
    prefix = torch.randint(0, model.cfg.vocab_size, (s.prefix,), generator=gen).tolist()
    shared = [prefix + torch.randint(0, model.cfg.vocab_size, (s.suffix,), generator=gen).tolist() for _ in range(n)]
    short = SamplingParams(temperature=0, max_tokens=s.prefix_new, ignore_eos=True)
    seconds, llms = {}, {}
    for caching in (False, True):
        llms[caching] = LLM(model, tok, **s.engine, enable_prefix_caching=caching)
        llms[caching].generate([prefix + [1]], SamplingParams(temperature=0, max_tokens=1))  # fills the cache
        seconds[caching] = timer(lambda llm=llms[caching]: llm.generate(shared, short))[1]
    steps = s.prefix_new + 1
    cost = step_cost(lambda: llms[True].generate(shared, short), steps, seconds[True] / steps, device)
    return shown("prefix cache", f"{seconds[True]:.2f} s (on)", f"{seconds[False]:.2f} s (off)",
            f"{seconds[False] / seconds[True]:.2f}×", *cost.cells(), f"{n} × ({s.prefix} shared + {s.suffix}) → "
            f"{s.prefix_new}")


def speculative_row(model, tok, s: Shapes, device: torch.device, timer: Timer, one, sf_ms: float) -> tuple:
    """Random weights: the MTP module's drafts are rarely accepted, so this row shows the verify pass's cost and
    the acceptance rate measured, not the speed-up a trained model gets (spec_decode.py)."""
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0, max_tokens=s.new, ignore_eos=True)
    spec = LLM(model, tok, **s.engine, speculative_tokens=1)
    plain = LLM(model, tok, **s.engine)
    spec.generate(one.tolist(), SamplingParams(temperature=0, max_tokens=4))  # warm-up
    spec_ms = min(1000 * (timer(lambda: spec.generate(one.tolist(), decode))[1]
                          - timer(lambda: spec.generate(one.tolist(), first))[1]) / (s.new - 1) for _ in range(3))
    cost = step_cost(lambda: spec.generate(one.tolist(), decode), s.new, spec_ms / 1000, device)
    same = spec.generate(one.tolist(), decode)[0].outputs[0].token_ids == \
        plain.generate(one.tolist(), decode)[0].outputs[0].token_ids
    return shown("speculative", f"{spec_ms:.2f} ms/token (k=1)", f"{sf_ms:.2f} ms/token (k=0)",
                 f"{sf_ms / spec_ms:.2f}×", *cost.cells(), f"batch 1, MTP drafts accepted "
                 f"{spec.engine.spec.acceptance_rate:.0%} (random weights); "
                 f"greedy output {'identical' if same else 'DIFFERS'}")


def print_table(rows: list[tuple]) -> None:
    header = ("measurement", "seekforge", "transformers / baseline", "speed-up", "launches/step", "host syncs/step",
              "GPU busy", "notes")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, seconds: checks the suite runs")
    p.add_argument("--check", action="store_true",
                   help="instead of the rows: every fast path vs its reference (check.py); exit status 1 on a failure")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: the suite measures a GPU; use --dry-run to check it on the CPU")
    s = DRY if args.dry_run else GPU
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        dtype, _ = machine_header("auto")
        print("DRY RUN: tiny shapes on the CPU; the numbers only show that every row runs")
    else:
        dtype, _ = machine_header("bf16", probe_peak=False)
        props = torch.cuda.get_device_properties(device)
        print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, "
              f"date {time.strftime('%Y-%m-%d')}")
    if args.check:
        from check import run_checks

        sys.exit(0 if run_checks(device, dry_run=args.dry_run) else 1)
    with forced_gpu_path() if args.dry_run else contextlib.nullcontext():  # the GPU's code, also in the dry run
        rows(s, device, dtype, compiled_row=not args.dry_run)


def rows(s: Shapes, device: torch.device, dtype: torch.dtype, compiled_row: bool) -> None:
    """The suite's table. compiled_row: also the train step with compiled blocks (minutes of inductor on a CPU:
    not in the dry run)."""
    start = time.perf_counter()
    dtype_name = "bf16" if dtype == torch.bfloat16 else "fp32"
    cfg = ModelConfig(**s.model)
    params = cfg.num_params()
    print(f"model: DeepSeek-V3-shaped, {params['total'] / 1e6:,.1f}M parameters ({params['mtp'] / 1e6:,.1f}M MTP), "
          f"{params['active'] / 1e6:,.1f}M active per token; {flops_per_token(cfg, s.seq) / 1e6:,.1f} MFLOP/token "
          f"training; dtype {dtype_name}")
    timer = Timer(device)
    table = [train_row(cfg, s, device, dtype_name, timer, compiled=False)]
    if compiled_row:
        table.append(train_row(cfg, s, device, dtype_name, timer, compiled=True))
    print(f"[{time.perf_counter() - start:.0f} s] train steps done")
    table += serve_rows(cfg, s, device, dtype, timer)
    print(f"[{time.perf_counter() - start:.0f} s] serving done")
    print_table(table)


if __name__ == "__main__":
    main()
