"""The distributed engine (serve/distributed.py) on 2 gloo ranks vs the single-device engine, same run.

The `small` preset (fp32, random weights), N concurrent greedy requests: output tokens per second of
the single-device LLMEngine (1 thread) and of the 2-rank engine (1 thread per rank) under TP=2 and
under DP-attention=2 + EP=2, each checked token for token against the single-device outputs. Then the
train → infer sync: the GRPO trainer's layout under torchrun (FSDP2 over both ranks) into the
DP-attention=2 + EP=2 engine through RankEngine.sync_weights (parallel/transfer.py), best of 3.

    PYTHONPATH=. python benchmarks/serve_parallel.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_header  # noqa: E402

from seekforge.config import EngineConfig, preset  # noqa: E402
from seekforge.serve.sequence import SamplingParams  # noqa: E402

PRESET = "small"
ENGINE = dict(block_size=16, kv_cache_memory="256MiB", max_num_batched_tokens=1024)


def workload(cfg, requests: int, prompt_len: int, max_tokens: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    return prompts, [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * requests


def single_device(args) -> tuple[float, list]:
    from seekforge.serve.engine import LLM

    llm = LLM(PRESET, dtype=torch.float32, **ENGINE)
    prompts, params = workload(llm.engine.model.cfg, args.requests, args.prompt_len, args.max_tokens)
    llm.generate(prompts[:1], params[:1])  # warm up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def _rank(rank: int, world: int, tmp: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        from seekforge.model.model import build_model
        from seekforge.rl.collectives import shard_policy
        from seekforge.serve.distributed import DistributedEngine, build

        result = {}
        for name, (tp, dp_attention, ep) in {"tp2": (2, 1, 1), "dp-attention2+ep2": (1, 2, 2)}.items():
            rank_engine = build(PRESET, tp, dp_attention, ep, torch.float32, EngineConfig(**ENGINE))
            if rank != 0:
                rank_engine.follow_forever()
                continue
            engine = DistributedEngine(rank_engine)
            prompts, params = workload(engine.model.cfg, args.requests, args.prompt_len, args.max_tokens)
            engine.generate(prompts[:1], params[:1])  # warm up
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            result[name] = (time.perf_counter() - start, [o.outputs[0].token_ids for o in outs])
            engine.shutdown()
        policy = build_model(preset(PRESET), seed=1)
        shard_policy(policy)
        times = []
        for _ in range(3):
            dist.barrier()
            stats = rank_engine.sync_weights(policy)  # the last engine built: DP-attention 2 + EP 2
            dist.barrier()
            times.append(stats.seconds)
        if rank == 0:
            result["sync"] = (min(times), stats.bytes_moved, stats.rounds)
            (Path(tmp) / "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    machine_header("fp32", probe_peak=False)
    seconds, reference = single_device(args)
    tokens = args.requests * args.max_tokens
    print(f"[{PRESET}] fp32, {args.requests} concurrent greedy requests, {args.prompt_len} prompt + "
          f"{args.max_tokens} output tokens each")
    print(f"single device (1 thread)          : {tokens / seconds:7.1f} output tok/s ({seconds:.2f} s)")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
        mp.spawn(_rank, args=(2, tmp, args), nprocs=2, join=True)
        result = json.loads((Path(tmp) / "result.json").read_text())  # rank 0's own numbers
    for name in ("tp2", "dp-attention2+ep2"):
        s, outs = result[name]
        print(f"{name:<17} 2 gloo ranks x 1 th: {tokens / s:7.1f} output tok/s ({s:.2f} s), ratio vs single "
              f"device {seconds / s:.2f}x, outputs equal: {outs == [list(r) for r in reference]}")
    s, moved, rounds = result["sync"]
    print(f"sync FSDP2 (2 ranks) -> dp-attention2+ep2 engine: {s * 1e3:.1f} ms, {moved / 2**20:.1f} MiB moved in "
          f"{rounds} round(s), best of 3")


if __name__ == "__main__":
    main()
