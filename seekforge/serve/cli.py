"""`seekforge serve`: load a model (or join a torchrun job, serve/distributed.py), build the engine and
serve it over HTTP (server.build_app behind limits.py). Flags mirror vLLM's where they exist."""

from __future__ import annotations

import gc
import logging
import os

from seekforge.config import PRESETS
from seekforge.model.precision import auto_dtype_help
from seekforge.serve import limits
from seekforge.serve.async_engine import AsyncEngine
from seekforge.serve.server import build_app

log = logging.getLogger("seekforge.serve")


def add_arguments(p):
    p.add_argument("--model", default="tiny", help="preset name or HF-format checkpoint directory")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` name clients send; when unset, the --model value")
    p.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes the server")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32", "bfloat16", "float32"], default="auto",
                   help=f"auto: {auto_dtype_help()}")
    p.add_argument("--kv-cache-memory", default="512MiB", help="memory for the paged latent KV cache")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="int8: cache c_kv and k_pe per token in int8 with an fp32 scale (about 1/2 of bf16's bytes)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoding at once, at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens one step computes, at most (a long prompt prefills in chunks of this size)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request, at most (None: the model's max_position_embeddings)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute shared prompt prefixes instead of reusing their cached blocks")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="k > 0: the model's MTP modules draft k tokens per step, one pass verifies them")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="N > 1: N decode steps per scheduler pass while no prefill waits")
    p.add_argument("--compile", action="store_true",
                   help="run decode steps as torch.compile'd programs (needs a C++ compiler; minutes at start the "
                        "first time, seconds from the compile cache after): faster decoding, most at batch 1 "
                        "(BENCHMARKS.md); falls back to eager, with a warning, where compiling fails")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on a GPU, run every decode step eagerly instead of replaying the CUDA graphs captured at "
                        "start (serve/graphs.py: plain decode steps of up to --max-cuda-graph-batch sequences)")
    p.add_argument("--max-cuda-graph-batch", type=int, default=256,
                   help="on a GPU, the largest batch of decoding sequences captured as a CUDA graph (capped at "
                        "--max-num-seqs); larger decode batches run eagerly")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (POST /v1/load_lora_adapter at run time); implied by --lora-modules")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapter directories to load at start; a request's `model` selects one by NAME")
    p.add_argument("--tp", type=int, default=1,
                   help="under torchrun: attention (and dense MLP) tensor parallel over this many ranks per replica")
    p.add_argument("--dp-attention", type=int, default=1,
                   help="under torchrun: attention data parallel: this many replicas, each with its own requests, "
                        "scheduler and latent cache (world size = tp x dp-attention)")
    p.add_argument("--ep", type=int, default=1,
                   help="under torchrun: split the routed experts over groups of this many ranks (all-to-all dispatch)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS, else the cores this process may use: CPU "
                        "affinity, cgroup quota)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="server log verbosity")
    p.add_argument("--trace-dir", default="traces", help="where POST /debug/trace and SIGUSR2 write profiler traces")
    limits.add_arguments(p)


def engine_config_from_args(args):
    from seekforge.config import EngineConfig

    return EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_chunked_prefill=not args.no_chunked_prefill,
                        enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                        speculative_tokens=args.speculative_tokens, num_scheduler_steps=args.num_scheduler_steps,
                        enable_lora=args.enable_lora or bool(args.lora_modules), compile=args.compile,
                        cuda_graphs=not args.no_cuda_graphs, max_cuda_graph_batch=args.max_cuda_graph_batch)


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """["name=path", ...] → [(name, path)]."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: write NAME=PATH (a PEFT adapter directory)")
        pairs.append((name, path))
    return pairs


def apply_threads(args) -> None:
    """torch's CPU threads for this process: --threads, else model/threads.default_threads. Before the model loads:
    a compiled step's kernels are generated for one thread count."""
    import torch

    from seekforge.model.threads import default_threads

    if args.threads:
        count, why = args.threads, "--threads"
    else:  # never more than torch's own default (the physical cores): default_threads counts logical ones
        count, why = default_threads()
        if count > torch.get_num_threads():
            count, why = torch.get_num_threads(), "torch's default: the physical cores"
    torch.set_num_threads(count)
    log.info("threads: %d (%s); %s", count, why, getattr(args, "openmp_policy", "OpenMP wait policy: as set"))


def run(args):
    from seekforge.model.load import checkpoint_dir, model_width
    from seekforge.model.precision import resolve_dtype
    from seekforge.quant.load import load_model  # quantized checkpoints too
    from seekforge.serve.engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # flags that need no model are checked before the model loads
    limits.limits_from_args(args)
    parse_lora_modules(args.lora_modules)
    if args.model not in PRESETS:
        checkpoint_dir(args.model)  # a path that is no checkpoint fails before threads, dtype and ranks
    apply_threads(args)
    dtype, why = resolve_dtype(args.dtype, hidden_size=model_width(args.model))
    log.info("dtype: %s", why)
    if args.tp * args.dp_attention * args.ep > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return run_distributed(args, dtype)
    model, tokenizer = load_model(args.model, dtype)
    core = LLMEngine(model, tokenizer, engine_config_from_args(args))
    for name, path in parse_lora_modules(args.lora_modules):
        core.load_lora(name, path)
    serve_engine(core, args)


def serve_engine(core, args) -> None:
    engine = AsyncEngine(core)
    app = build_app(engine, args.served_model_name or args.model, args.api_key, args.trace_dir)
    app.state.serve.tracer.install_signal()
    # By now hundreds of thousands of objects are alive (the compiled programs, the pools' block records), and a full
    # collection of them stalls every stream it lands on, far longer than a decode step. Frozen, the collector passes
    # over them, as vLLM does after its startup; what serving allocates later is collected as usual.
    gc.collect()
    gc.freeze()
    try:
        limits.serve(app, limits.limits_from_args(args), args.host, args.port, args.log_level)
    finally:
        engine.shutdown()


def run_distributed(args, dtype) -> None:
    """Under torchrun (serve/distributed.py): rank 0 serves HTTP; the other ranks step with it."""
    import torch.distributed as dist

    from seekforge.serve.distributed import start

    core = start(args.model, args.tp, args.dp_attention, args.ep, dtype, engine_config_from_args(args))
    try:
        if core is not None:  # rank 0; the others return once rank 0 stops them
            try:
                serve_engine(core, args)
            finally:
                core.shutdown()
    finally:
        dist.destroy_process_group()
