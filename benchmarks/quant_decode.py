"""Quantized decode: seekforge int8 / int4 checkpoints vs the same model in bf16 and fp32, and vs
transformers + torchao quantization of the same scheme, measured in one run.

    python benchmarks/quant_decode.py --model runs/default/hf \
        --quantized w8a8-dynamic=/tmp/q/w8a8d w4a16-gptq=/tmp/q/w4g ...

(make the quantized checkpoints with `seekforge quantize`; BENCHMARKS.md has the commands.)

Per checkpoint: held-out perplexity (builtin:text valid split) and its delta vs bf16, arithmetic accuracy
(greedy), model bytes (safetensors on disk), batch-1 decode ms/token (one request, 64 new tokens, time
after the first token) and batch-64 throughput (64 requests × 32 new tokens, continuous batching).
Every seekforge row runs the same engine; only the linears differ. The quantized rows run with bf16
activations (`--act-dtype`), so their decode time is comparable with the bf16 row.

Peer: transformers DeepseekV3ForCausalLM loaded from the same bf16/fp32 checkpoint, then torchao's
`Int8DynamicActivationInt8WeightConfig` (W8A8 dynamic) applied with `quantize_` — what transformers'
TorchAoConfig does on load. torchao 0.18's int4 weight-only configs have no CPU packing format, so
there is no torchao W4A16 row on CPU. torchao quantizes nn.Linear only: transformers' fused expert
tensors stay bf16 in the peer.
"""

from __future__ import annotations

import argparse
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


def engine_decode(model, tokenizer, repeats: int) -> tuple[float, float]:
    """→ (batch-1 decode ms/token, batch-64 tokens/s)."""
    llm = LLM(model, tokenizer, kv_cache_memory="256MiB")
    one = prompts(1, model.cfg.vocab_size)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate(one, greedy(4))  # warm-up: kernel layouts, allocator
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(one, greedy(1))
        t1 = time.perf_counter()
        llm.generate(one, greedy(65))
        t2 = time.perf_counter()
        best = min(best, ((t2 - t1) - (t1 - t0)) / 64 * 1e3)
    batch = prompts(64, model.cfg.vocab_size, seed=1)
    t0 = time.perf_counter()
    llm.generate(batch, greedy(32))
    throughput = 64 * 32 / (time.perf_counter() - t0)
    return best, throughput


def hf_decode_ms(hf, vocab: int, repeats: int) -> float:
    ids = torch.tensor(prompts(1, vocab))
    run = lambda n: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,  # noqa: E731
                                do_sample=False, pad_token_id=0)
    with torch.no_grad():
        run(4)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(1)
            t1 = time.perf_counter()
            run(65)
            t2 = time.perf_counter()
            best = min(best, ((t2 - t1) - (t1 - t0)) / 64 * 1e3)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the unquantized HF checkpoint")
    p.add_argument("--quantized", nargs="*", default=[], help="NAME=DIR compressed-tensors checkpoints")
    p.add_argument("--act-dtype", default="bf16", choices=["bf16", "fp32"], help="activations of quantized rows")
    p.add_argument("--num-samples", type=int, default=32, help="held-out samples of 256 tokens for perplexity")
    p.add_argument("--num-questions", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3, help="batch-1 timings: best of this many")
    p.add_argument("--no-peer", action="store_true", help="skip transformers + torchao")
    args = p.parse_args()
    machine_header("bf16", probe_peak=False)
    act = torch.bfloat16 if args.act_dtype == "bf16" else torch.float32
    rows = [("bf16", args.model, torch.bfloat16), ("fp32", args.model, torch.float32)]
    rows += [(name, path, act) for name, path in (q.split("=", 1) for q in args.quantized)]
    print(f"quantized rows: {args.act_dtype} activations; perplexity on {args.num_samples}×256 held-out tokens, "
          f"accuracy on {args.num_questions} arithmetic questions\n")
    header = f"{'scheme':<16} {'ppl':>8} {'Δppl vs bf16':>12} {'acc':>6} {'MB':>7} {'b1 ms/tok':>10} {'b64 tok/s':>10}"
    print(header)
    results = {}
    base_ppl = None
    for name, path, dtype in rows:
        torch.manual_seed(0)
        model, tokenizer = load_model(path, dtype)
        ppl = perplexity(model, tokenizer, args.num_samples)
        base_ppl = base_ppl or ppl
        acc = task_accuracy(model, tokenizer, args.num_questions) if args.num_questions else float("nan")
        ms, tps = engine_decode(model, tokenizer, args.repeats)
        results[name] = ms
        # unquantized rows: their weights in that dtype (the checkpoint file may hold another dtype)
        size = (model_bytes(Path(path)) if name not in ("bf16", "fp32")
                else sum(t.numel() * t.element_size() for t in model.state_dict().values())) / 1e6
        delta = 100 * (ppl / base_ppl - 1)
        print(f"{name:<16} {ppl:8.4f} {delta:+11.2f}% {acc:6.3f} {size:7.2f} {ms:10.2f} {tps:10.1f}", flush=True)
    for name, ms in results.items():
        if name != "bf16":
            print(f"batch-1 decode, {name} vs bf16: {results['bf16'] / ms:.2f}x")
    if args.no_peer:
        return
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        print("peer: torchao is not installed (pip install torchao); no transformers + torchao rows")
        return
    from transformers import AutoModelForCausalLM

    vocab = load_model(args.model)[0].cfg.vocab_size
    print("\ntransformers (same checkpoint) batch-1 decode ms/token:")
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    hf_bf16 = hf_decode_ms(hf, vocab, args.repeats)
    quantize_(hf, Int8DynamicActivationInt8WeightConfig())
    hf_w8a8 = hf_decode_ms(hf, vocab, args.repeats)
    print(f"transformers bf16           {hf_bf16:8.2f}")
    print(f"transformers+torchao w8a8   {hf_w8a8:8.2f}   (torchao vs transformers bf16: {hf_bf16 / hf_w8a8:.2f}x)")
    if "w8a8-dynamic" in results:
        print(f"seekforge w8a8-dynamic vs transformers+torchao w8a8: {hf_w8a8 / results['w8a8-dynamic']:.2f}x")


if __name__ == "__main__":
    main()
