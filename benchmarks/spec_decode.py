"""MTP speculative decoding: batch-1 decode speed and acceptance, with vs without, same run.

    python benchmarks/spec_decode.py --model runs/default/hf      # the `seekforge pretrain` output

For each k in --ks: the same prompts (the start of held-out built-in text stories), one request at a
time, G new tokens each (ignore_eos, so every run generates exactly G), greedy. Reports ms per output
token after the first, the speed-up vs k = 0 (the peer: the same engine without drafts), the MTP
acceptance rate and mean accepted length (tokens gained per verify pass), and checks that every
greedy output equals k = 0's. A sampled run (temperature --temperature) reports its acceptance too.

Timings on a shared CPU are noisy (±10–20%); ratios within one run are the meaningful numbers.
"""

from __future__ import annotations

import argparse
import random
import time

from machine import machine_header, parse_args  # benchmarks/machine.py

from seekforge.data.corpora import story
from seekforge.model.load import load_model
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    """One request at a time → outputs and ms per token after the first (mean over prompts)."""
    outputs, per_token = [], []
    for prompt in prompts:
        start = time.perf_counter()
        (out,) = llm.generate([prompt], params)
        total = time.perf_counter() - start
        first = out.ttft or 0.0
        outputs.append(out.outputs[0].token_ids)
        per_token.append((total - first) / (len(out.outputs[0].token_ids) - 1))
    return outputs, 1e3 * sum(per_token) / len(per_token)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/default/hf")
    p.add_argument("--ks", default="1,2,3", help="speculative token counts to compare with 0")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-chars", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    args = parse_args(p, threads=1)
    dtype, _ = machine_header(args.dtype)
    model, tokenizer = load_model(args.model, dtype)
    rng = random.Random(1234)  # not the training seed's stories
    prompts = [tokenizer.encode(story(rng)[:args.prompt_chars]) for _ in range(args.num_prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    print(f"model {args.model}: {args.num_prompts} prompts x {args.new_tokens} new tokens, batch 1, "
          f"MTP modules: {len(model.mtp)}")
    base = LLM(model, tokenizer)
    run(base, prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    ref, base_ms = run(base, prompts, greedy)
    print(f"{'k':>3} {'ms/token':>9} {'speed-up':>9} {'accept':>7} {'mean len':>9} {'same output':>12} "
          f"{'sampled accept':>15} {'sampled len':>12}")
    print(f"{0:>3} {base_ms:>9.2f} {1.0:>9.2f} {'-':>7} {'-':>9} {'-':>12}")
    for k in [int(x) for x in args.ks.split(",")]:
        llm = LLM(model, tokenizer, speculative_tokens=k)
        out, ms = run(llm, prompts, greedy)
        spec = llm.engine.spec
        rate, length = spec.acceptance_rate, spec.mean_accepted_length
        llm = LLM(model, tokenizer, speculative_tokens=k)
        run(llm, prompts, sampled)
        s = llm.engine.spec
        print(f"{k:>3} {ms:>9.2f} {base_ms / ms:>9.2f} {rate:>7.2f} {length:>9.2f} {str(out == ref):>12} "
              f"{s.acceptance_rate:>15.2f} {s.mean_accepted_length:>12.2f}")


if __name__ == "__main__":
    main()
