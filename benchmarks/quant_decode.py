"""Quantized decode: seekforge int8 / int4 checkpoints vs the same model in bf16 and fp32, and vs
transformers + torchao quantization of the same scheme, measured in one run.

    python benchmarks/quant_decode.py --model runs/default/hf \
        --quantized w8a8-dynamic=/tmp/q/w8a8d w4a16-gptq=/tmp/q/w4g ...

(make the quantized checkpoints with `seekforge quantize`; BENCHMARKS.md has the commands.)

Per checkpoint: held-out perplexity (builtin:text valid split) and its delta vs bf16, arithmetic accuracy
(greedy), model bytes (safetensors on disk), batch-1 decode ms/token (one request: the time of 65 new
tokens minus that of 1, over 64) and batch-64 throughput (64 requests × 32 new tokens, continuous batching).
Every seekforge row runs the same engine; only the linears differ. The quantized rows run with bf16
activations (`--act-dtype`), so their decode time is comparable with the bf16 row.

Timing on a shared machine: every engine is built and warmed first, then `--repeats` rounds time each
row once, in an order rotated every round, so that load changes hit all rows alike. Each timing is
taken twice: wall clock and the process's CPU time (`time.process_time`; with one torch thread, the
work done, without the time spent waiting for a core while other processes run). The table gives
the median over rounds; "vs bf16" is the median of the per-round ratios to the bf16 row of the same
round, with their range. The load average is printed before and after every round.

Peer: transformers DeepseekV3ForCausalLM loaded from the same bf16/fp32 checkpoint, then torchao's
`Int8DynamicActivationInt8WeightConfig` (W8A8 dynamic) applied with `quantize_` — what transformers'
TorchAoConfig does on load. torchao 0.18's int4 weight-only configs have no CPU packing format, so
there is no torchao W4A16 row on CPU. torchao quantizes nn.Linear only: transformers' fused expert
tensors stay bf16 in the peer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from machine import machine_header  # benchmarks/machine.py

from seekforge.quant.eval import perplexity, task_accuracy
from seekforge.quant.load import load_model
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams

PROMPT_LEN = 32


def model_bytes(path: Path) -> int:
    """A quantized checkpoint's safetensors bytes on disk (packed int4 / int8 weights, scales, the rest)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 256), (n, PROMPT_LEN), generator=gen).tolist()


def decode_times(generate, n_new: int) -> tuple[float, float]:
    """generate(n) runs n new tokens → (CPU ms, wall ms) per token after the first (prefill excluded)."""
    c0, w0 = time.process_time(), time.perf_counter()
    generate(1)
    c1, w1 = time.process_time(), time.perf_counter()
    generate(n_new + 1)
    c2, w2 = time.process_time(), time.perf_counter()
    return ((c2 - c1) - (c1 - c0)) / n_new * 1e3, ((w2 - w1) - (w1 - w0)) / n_new * 1e3


class EngineTimer:
    """One row's engine, warmed up; each call of `batch1` / `batch64` is one timing."""

    def __init__(self, model, tokenizer):
        self.llm = LLM(model, tokenizer, kv_cache_memory="64MiB")
        self.one = prompts(1, model.cfg.vocab_size)
        self.batch = prompts(64, model.cfg.vocab_size, seed=1)
        self.llm.generate(self.one, greedy(4))  # warm-up: kernel layouts, allocator
        self.llm.generate(self.batch[:8], greedy(4))

    def batch1(self) -> tuple[float, float]:
        return decode_times(lambda n: self.llm.generate(self.one, greedy(n)), 64)

    def batch64(self) -> tuple[float, float]:
        """→ (tokens per CPU second, tokens per wall second)."""
        c0, w0 = time.process_time(), time.perf_counter()
        self.llm.generate(self.batch, greedy(32))
        return 64 * 32 / (time.process_time() - c0), 64 * 32 / (time.perf_counter() - w0)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def interleaved(timers: dict, what: str, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """`repeats` rounds; each round times every row once, starting one row later than the round before."""
    names, times = list(timers), {name: [] for name in timers}
    for r in range(repeats):
        print(f"  {what} round {r + 1}/{repeats}: {load()}", flush=True)
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(getattr(timers[name], what)())
    print(f"  after: {load()}", flush=True)
    return times


def paired_ratio(times: dict, name: str, base: str = "bf16", rate: bool = False) -> str:
    """Median and range of the per-round ratios name vs base on CPU time (times: ms per token; rate:
    tokens per second): > 1 means name is faster."""
    ratios = [t[0] / b[0] if rate else b[0] / t[0] for t, b in zip(times[name], times[base], strict=True)]
    return f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}–{max(ratios):.2f})"


class HFTimer:
    """A transformers model's batch-1 greedy decode, timed like EngineTimer.batch1."""

    def __init__(self, hf, vocab: int):
        self.hf, self.ids = hf, torch.tensor(prompts(1, vocab))
        self.run(4)

    @torch.no_grad()
    def run(self, n: int):
        return self.hf.generate(self.ids, attention_mask=torch.ones_like(self.ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)

    def batch1(self) -> tuple[float, float]:
        return decode_times(self.run, 64)


def peer_timers(model_dir: str, vocab: int) -> dict:
    """transformers bf16, and transformers + torchao W8A8 dynamic (what TorchAoConfig applies on load)."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        print("peer: torchao is not installed (pip install torchao); no transformers + torchao rows")
        return {}
    from transformers import AutoModelForCausalLM

    def load_hf():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    quantized = load_hf()
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
    return {"hf bf16": HFTimer(load_hf(), vocab), "hf+torchao w8a8": HFTimer(quantized, vocab)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the unquantized HF checkpoint")
    p.add_argument("--quantized", nargs="*", default=[], help="NAME=DIR compressed-tensors checkpoints")
    p.add_argument("--act-dtype", default="bf16", choices=["bf16", "fp32"], help="activations of quantized rows")
    p.add_argument("--num-samples", type=int, default=32, help="held-out samples of 256 tokens for perplexity")
    p.add_argument("--num-questions", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7, help="interleaved batch-1 timing rounds (median)")
    p.add_argument("--repeats-b64", type=int, default=3, help="interleaved batch-64 timing rounds (median)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers + torchao")
    args = p.parse_args()
    machine_header("bf16", probe_peak=False)
    print(f"start: {load()} on {os.cpu_count()} logical CPUs")
    act = torch.bfloat16 if args.act_dtype == "bf16" else torch.float32
    rows = [("bf16", args.model, torch.bfloat16), ("fp32", args.model, torch.float32)]
    rows += [(name, path, act) for name, path in (q.split("=", 1) for q in args.quantized)]
    print(f"quantized rows: {args.act_dtype} activations; perplexity on {args.num_samples}×256 held-out tokens, "
          f"accuracy on {args.num_questions} arithmetic questions\n")
    quality, timers, base_ppl = {}, {}, None
    for name, path, dtype in rows:
        torch.manual_seed(0)
        model, tokenizer = load_model(path, dtype)
        ppl = perplexity(model, tokenizer, args.num_samples)
        base_ppl = base_ppl or ppl
        acc = task_accuracy(model, tokenizer, args.num_questions) if args.num_questions else float("nan")
        # unquantized rows: their weights in that dtype (the checkpoint file may hold another dtype)
        size = (model_bytes(Path(path)) if name not in ("bf16", "fp32")
                else sum(t.numel() * t.element_size() for t in model.state_dict().values())) / 1e6
        quality[name] = (ppl, 100 * (ppl / base_ppl - 1), acc, size)
        print(f"{name:<16} ppl {ppl:.4f}  acc {acc:.3f}  ({load()})", flush=True)
        timers[name] = EngineTimer(model, tokenizer)
    peers = {} if args.no_peer else peer_timers(args.model, next(iter(timers.values())).llm.engine.model.cfg.vocab_size)
    print("\ntiming (interleaved rounds):")
    b1 = interleaved({**timers, **peers}, "batch1", args.repeats)
    b64 = interleaved(timers, "batch64", args.repeats_b64)
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    print(f"\nmedians of {args.repeats} (batch-1) and {args.repeats_b64} (batch-64) interleaved rounds; "
          "cpu = process CPU time, wall = wall clock")
    print(f"{'scheme':<16} {'ppl':>8} {'Δppl':>8} {'acc':>6} {'MB':>7} {'b1 cpu ms/tok':>13} {'b1 wall':>8} "
          f"{'b64 tok/cpu-s':>13} {'b64 tok/s':>10}")
    for name, (ppl, delta, acc, size) in quality.items():
        print(f"{name:<16} {ppl:8.4f} {delta:+7.2f}% {acc:6.3f} {size:7.2f} {med(b1[name], 0):13.2f} "
              f"{med(b1[name], 1):8.2f} {med(b64[name], 0):13.1f} {med(b64[name], 1):10.1f}")
    for name in peers:
        print(f"{name:<16} {'':>8} {'':>8} {'':>6} {'':>7} {med(b1[name], 0):13.2f} {med(b1[name], 1):8.2f}")
    print("\nbatch-1 decode vs bf16 (CPU time, median of per-round ratios, > 1: faster than bf16):")
    for name in quality:
        if name != "bf16":
            print(f"  {name:<16} {paired_ratio(b1, name)}   batch-64: {paired_ratio(b64, name, rate=True)}")
    if peers:
        print(f"  hf+torchao w8a8 vs hf bf16: {paired_ratio(b1, 'hf+torchao w8a8', 'hf bf16')}")
        if "w8a8-dynamic" in timers:
            print(f"  seekforge w8a8-dynamic vs hf+torchao w8a8: {paired_ratio(b1, 'w8a8-dynamic', 'hf+torchao w8a8')}")


if __name__ == "__main__":
    main()
