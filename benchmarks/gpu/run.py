"""The GPU suite: one script, one table, under 8 minutes on one H200.

    PYTHONPATH=. python benchmarks/gpu/run.py             # needs a CUDA GPU
    PYTHONPATH=. python benchmarks/gpu/run.py --dry-run   # tiny shapes on the CPU, seconds (tests run this)

Rows (bf16 on the GPU; the dry run uses the CPU's auto dtype):
  train step     seekforge's Trainer.train_step (AdamW, bf16 autocast over fp32 master weights) on a
                 ~1B-parameter DeepSeek-V3-shaped model (MLA with kv_lora_rank 512 + rope 64, 16 routed
                 experts top-4 + 1 shared, MTP): tokens/s and MFU against the bf16 matmul peak measured
                 on this device in the same run; whether the experts ran through torch._grouped_mm is
                 printed (counted, not assumed).
  decode         batch-1 ms/token: seekforge's engine (LLM) vs transformers `generate`, same weights
                 (logits checked equal in fp32 first), greedy.
  throughput     N requests × (prompt + new tokens), continuous batching vs one `generate` batch.
  prefix cache   N requests sharing a long prefix, prefix caching on vs off.
  speculative    batch-1 decode with MTP speculative decoding (EngineConfig.speculative_tokens=1) vs
                 without, its acceptance rate, and whether the greedy output is unchanged.
The project never depends on a GPU: without one, only --dry-run runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: machine, train_step, serve_throughput
from machine import machine_header  # noqa: E402
from serve_throughput import hf_generate, hf_peer  # noqa: E402
from train_step import RepeatLoader  # noqa: E402

from seekforge.config import ModelConfig, TrainConfig  # noqa: E402
from seekforge.model.model import build_model  # noqa: E402
from seekforge.model.tokenizer import load_tokenizer  # noqa: E402
from seekforge.serve.engine import LLM  # noqa: E402
from seekforge.serve.sequence import SamplingParams  # noqa: E402
from seekforge.train.flops import flops_per_token, measure_peak_flops  # noqa: E402

# DeepSeek-V3's shapes scaled to ~1.1B parameters (1.0B without MTP, 0.54B active per token): V3's MLA
# head (q_lora, kv_lora 512, nope 128 + rope 64, v 128), sigmoid group-limited routing, one dense layer.
GPU_MODEL = dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=704,
                 num_hidden_layers=12, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16,
                 n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                 num_nextn_predict_layers=1, max_position_embeddings=4096)
# The same structure in miniature (every feature on), for the CPU dry run.
DRY_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                 n_group=2, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=1,
                 max_position_embeddings=512)


@dataclass
class Shapes:
    model: dict
    batch: int  # training micro-batch
    seq: int
    steps: int  # timed training steps (median reported)
    requests: int
    prompt: int
    new: int
    prefix: int  # shared-prefix workload: common prefix, unique suffix, new tokens
    suffix: int
    prefix_new: int
    kv_cache: str


GPU = Shapes(GPU_MODEL, batch=8, seq=2048, steps=10, requests=128, prompt=256, new=256, prefix=2048, suffix=64,
             prefix_new=16, kv_cache="16GiB")
DRY = Shapes(DRY_MODEL, batch=2, seq=32, steps=2, requests=4, prompt=16, new=8, prefix=32, suffix=4, prefix_new=4,
             kv_cache="16MiB")


class Timer:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, fn):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start


class GroupedMMCounter:
    """Counts torch._grouped_mm calls while active: did the experts really run as grouped GEMMs?"""

    def __enter__(self):
        self.calls, self._original = 0, getattr(torch, "_grouped_mm", None)
        if self._original is not None:
            def counted(*args, **kwargs):
                self.calls += 1
                return self._original(*args, **kwargs)
            torch._grouped_mm = counted
        return self

    def __exit__(self, *args):
        if self._original is not None:
            torch._grouped_mm = self._original


def train_row(cfg: ModelConfig, s: Shapes, device: torch.device, dtype: str, timer: Timer) -> tuple:
    from seekforge.train.trainer import Trainer

    tcfg = TrainConfig(preset="small", model=s.model, seq_len=s.seq, dtype=dtype, micro_batch_size=s.batch,
                       steps=1000, peak_flops=1.0, eval_interval=0)
    model = build_model(cfg, device=device, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (s.batch, s.seq + 1), generator=gen)
    trainer = Trainer(tcfg, model, RepeatLoader({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}),
                      out_dir="/tmp/unused")
    for _ in range(2):  # warm-up: AdamW states, kernels picked
        trainer.train_step()
    times = []
    with GroupedMMCounter() as grouped:
        for _ in range(s.steps):
            times.append(timer(trainer.train_step)[1])
    median = sorted(times)[len(times) // 2]
    peak = measure_peak_flops(trainer.compute_dtype, device, size=8192 if device.type == "cuda" else 1024)
    tokens_per_s = s.batch * s.seq / median
    mfu = tokens_per_s * trainer.flops_per_token / peak
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gemm = f"torch._grouped_mm calls/step {grouped.calls // s.steps}"
    return (f"{tokens_per_s:,.0f} tok/s, MFU {100 * mfu:.1f}%", "—", "—",
            f"{s.batch}×{s.seq}, peak {peak / 1e9:,.0f} GFLOP/s measured; {gemm}")


def serve_rows(cfg: ModelConfig, s: Shapes, device: torch.device, dtype: torch.dtype, timer: Timer) -> list[tuple]:
    source = build_model(cfg, seed=0).eval()  # fp32 on the CPU: the peer's logits are checked here
    hf = hf_peer(source).to(device=device, dtype=dtype)
    model = source.to(device=device, dtype=dtype)
    for m in model.moe_layers():  # routing state stays fp32, as build_model keeps it
        m.gate.float()
    model.init_buffers()
    tok = load_tokenizer("byte")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (s.requests, s.prompt), generator=gen)
    n, new = s.requests, s.new
    rows = []

    llm = LLM(model, tok, kv_cache_memory=s.kv_cache)
    llm.generate(prompts[:2].tolist(), SamplingParams(temperature=0, max_tokens=4))  # warm-up
    hf_generate(hf, prompts[:2, :16].to(device), 2)

    def per_token_ms(run_one, run_all):  # best of 3; the difference removes prefill and the first token
        return min(1000 * (timer(run_all)[1] - timer(run_one)[1]) / (new - 1) for _ in range(3))

    one = prompts[:1]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    sf_ms = per_token_ms(lambda: llm.generate(one.tolist(), first), lambda: llm.generate(one.tolist(), decode))
    hf_ms = per_token_ms(lambda: hf_generate(hf, one.to(device), 1), lambda: hf_generate(hf, one.to(device), new))
    rows.append(("decode batch-1", f"{sf_ms:.2f} ms/token", f"{hf_ms:.2f} ms/token", f"{sf_ms / hf_ms:.2f}×",
                 f"{new} new tokens after {s.prompt}; lower is better"))

    outs, t_sf = timer(lambda: llm.generate(prompts.tolist(), decode))
    hf_out, t_hf = timer(lambda: hf_generate(hf, prompts.to(device), new))
    same = sum(o.outputs[0].token_ids == h.tolist() for o, h in zip(outs, hf_out, strict=True))
    rows.append(("throughput", f"{n * new / t_sf:,.0f} new tok/s", f"{n * new / t_hf:,.0f} new tok/s",
                 f"{t_hf / t_sf:.2f}×", f"{n} × ({s.prompt} + {new}); greedy identical {same}/{n}"))
    hf = None  # frees the peer before the prefix workload

    prefix = torch.randint(0, cfg.vocab_size, (s.prefix,), generator=gen).tolist()
    shared = [prefix + torch.randint(0, cfg.vocab_size, (s.suffix,), generator=gen).tolist() for _ in range(n)]
    short = SamplingParams(temperature=0, max_tokens=s.prefix_new, ignore_eos=True)
    seconds = {}
    for caching in (False, True):
        cached_llm = LLM(model, tok, kv_cache_memory=s.kv_cache, enable_prefix_caching=caching)
        cached_llm.generate([prefix + [1]], SamplingParams(temperature=0, max_tokens=1))  # fills the cache
        seconds[caching] = timer(lambda cached_llm=cached_llm: cached_llm.generate(shared, short))[1]
    rows.append(("prefix cache", f"{seconds[True]:.2f} s (on)", f"{seconds[False]:.2f} s (off)",
                 f"{seconds[False] / seconds[True]:.2f}×", f"{n} × ({s.prefix} shared + {s.suffix}) → {s.prefix_new}"))

    # Random weights: the MTP module's drafts are rarely accepted, so this row shows the verify pass's
    # cost and the acceptance rate measured, not the speed-up a trained model gets (spec_decode.py).
    spec = LLM(model, tok, kv_cache_memory=s.kv_cache, speculative_tokens=1)
    spec.generate(prompts[:1].tolist(), SamplingParams(temperature=0, max_tokens=4))  # warm-up
    spec_ms = per_token_ms(lambda: spec.generate(one.tolist(), first), lambda: spec.generate(one.tolist(), decode))
    same = [x.generate(one.tolist(), decode)[0].outputs[0].token_ids for x in (spec, llm)]
    same = same[0] == same[1]
    rows.append(("speculative", f"{spec_ms:.2f} ms/token (k=1)", f"{sf_ms:.2f} ms/token (k=0)",
                 f"{sf_ms / spec_ms:.2f}×", f"batch 1, MTP drafts accepted {spec.engine.spec.acceptance_rate:.0%} "
                 f"(random weights); greedy output {'identical' if same else 'DIFFERS'}"))
    return rows


def print_table(rows: list[tuple]) -> None:
    header = ("measurement", "seekforge", "transformers / baseline", "speed-up", "notes")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, seconds: checks the suite runs")
    args = p.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: the suite measures a GPU; use --dry-run to check it on the CPU")
    s = DRY if args.dry_run else GPU
    device = torch.device("cpu" if args.dry_run else "cuda")
    start = time.perf_counter()
    if args.dry_run:
        dtype, _ = machine_header("auto")
        print("DRY RUN: tiny shapes on the CPU; the numbers only show that every row runs")
    else:
        dtype, _ = machine_header("bf16", probe_peak=False)
        props = torch.cuda.get_device_properties(device)
        print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    dtype_name = "bf16" if dtype == torch.bfloat16 else "fp32"
    cfg = ModelConfig(**s.model)
    params = cfg.num_params()
    print(f"model: DeepSeek-V3-shaped, {params['total'] / 1e6:,.1f}M parameters ({params['mtp'] / 1e6:,.1f}M MTP), "
          f"{params['active'] / 1e6:,.1f}M active per token; {flops_per_token(cfg, s.seq) / 1e6:,.1f} MFLOP/token "
          f"training; dtype {dtype_name}")
    timer = Timer(device)
    rows = [("train step", *train_row(cfg, s, device, dtype_name, timer))]
    print(f"[{time.perf_counter() - start:.0f} s] train step done")
    rows += serve_rows(cfg, s, device, dtype, timer)
    print(f"[{time.perf_counter() - start:.0f} s] serving done")
    print_table(rows)


if __name__ == "__main__":
    main()
