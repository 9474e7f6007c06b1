"""Multi-step scheduling: decode throughput with N = 1 vs N = 8 scheduler steps, same run.

    python benchmarks/multi_step.py                  # small preset, 64 concurrent x (32 prompt + 128 new)

64 requests admitted at once (greedy, ignore_eos so each generates exactly G tokens), run through
`LLM.generate` with `num_scheduler_steps` = each value of --steps. The peer is the same engine with
N = 1 (one schedule → prepare → sample → apply pass per token). Reports output tokens/s, the
ratio vs N = 1, and checks the outputs are identical.

Timings on a shared CPU are noisy (±10–20%); ratios within one run are the meaningful numbers.
"""

from __future__ import annotations

import argparse
import time

import torch
from machine import machine_header, parse_args  # benchmarks/machine.py

from seekforge.model.load import load_model
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset name or HF-format checkpoint directory")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", default="1,8", help="num_scheduler_steps values; the first is the peer")
    p.add_argument("--repeats", type=int, default=2)
    args = parse_args(p, threads=1)
    dtype, _ = machine_header(args.dtype)
    model, tokenizer = load_model(args.model, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(256, model.cfg.vocab_size), (args.prompt_len,), generator=g).tolist()
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"model {args.model}: {args.num_requests} concurrent requests x ({args.prompt_len} prompt + "
          f"{args.new_tokens} new tokens), greedy")
    LLM(model, tokenizer).generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    steps = [int(x) for x in args.steps.split(",")]
    best: dict[int, float] = {}
    outputs: dict[int, list] = {}
    for _ in range(args.repeats):  # alternate the settings, keep each one's best: load on a shared box drifts
        for n in steps:
            llm = LLM(model, tokenizer, num_scheduler_steps=n, max_num_seqs=args.num_requests)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - start)
            outputs[n] = [o.outputs[0].token_ids for o in outs]
    num_tokens = sum(len(t) for t in outputs[steps[0]])
    for n in steps:
        rate = num_tokens / best[n]
        print(f"num_scheduler_steps={n}: {rate:8.1f} output tok/s  (best of {args.repeats}: {best[n]:.2f} s)  "
              f"x{best[steps[0]] / best[n]:.2f} vs N={steps[0]}  outputs identical: {outputs[n] == outputs[steps[0]]}")

if __name__ == "__main__":
    main()
