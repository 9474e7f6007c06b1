"""Batch-1 decode on a busy machine: quiet against two busy-loop processes, 1 against 2 threads, the OpenMP runtime's
default wait policy against seekforge's thread policy (seekforge/model/threads.py), in one run.

    PYTHONPATH=. python benchmarks/serve_load.py              # ~5 min on 2 cores with a warm compile cache
    PYTHONPATH=. python benchmarks/serve_load.py --dry-run    # tiny model, eager, a few tokens: the wiring only

Model and engine as benchmarks/serve_peers.py's seekforge side: the `small` preset with kv_lora_rank 512 and
qk_rope_head_dim 64, MTP off, random weights (seed 0), compiled decode steps (EngineConfig.compile), the dtype
`auto` picks (--dtype). One 128-token prompt, ms per decoded token = (time for --new-tokens − time for 1) /
(--new-tokens − 1), --trials times; the median and the range are printed, with the load average beside them.

Each row's phase runs in a child process of its own (`--worker`), started quiet, or started once the background
load runs: OpenMP reads its wait policy once, when torch is imported, and a compiled step's kernels are generated
for one thread count, so seekforge decides both at start, as a server started on a quiet or a busy machine does.
  default, 1 / 2 threads   the OpenMP runtime's own wait policy (libgomp spins before it sleeps)
  seekforge policy         threads.configure_openmp (OMP_WAIT_POLICY=PASSIVE where other processes keep the cores
                           busy at start, the runtime's default elsewhere) + threads.default_threads (the cores this
                           process may use), as seekforge's CLI applies them
Load: --busy processes (default 2, one per core here), each a Python busy loop that ends by itself after
--load-seconds and is killed as soon as its measurement is done. "Quiet" means without them: other users of a
shared machine still count, which the load average beside each timing shows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from serve_peers import DRY_OVERRIDES, MODEL_OVERRIDES, RESULT  # benchmarks/serve_peers.py

# (label, wait policy, threads: a count or "auto" for threads.default_threads); each measured quiet, then loaded
ROWS = [
    ("default, 1 thread", "default", 1),
    ("default, 2 threads", "default", 2),
    ("seekforge policy", "seekforge", "auto"),
]
BUSY_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def background_load(processes: int, seconds: float):
    """`processes` busy loops, each ending by itself after `seconds` and killed when the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(seconds=seconds)]) for _ in range(processes)]
    try:
        time.sleep(0.5)  # every loop running before anything is measured
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def load_average() -> float:
    return os.getloadavg()[0]


# ------------------------------------------------------------------------------------------- worker
def worker(job: dict) -> dict:
    """One row's phase: set the wait policy and threads as the row says, build the engine, time decoding."""
    if job["wait"] == "seekforge":
        from seekforge.model import threads

        wait_why = threads.configure_openmp()  # before torch is imported, as the CLI does
        count, threads_why = threads.default_threads() if job["threads"] == "auto" else (job["threads"], "given")
    else:
        wait_why, (count, threads_why) = "the OpenMP runtime's default", (job["threads"], "given")
    import torch

    from seekforge.config import preset
    from seekforge.model.model import build_model
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.serve.engine import LLM
    from seekforge.serve.sequence import SamplingParams

    torch.set_num_threads(count)
    cfg = preset("tiny", **DRY_OVERRIDES) if job["dry_run"] else preset("small", **MODEL_OVERRIDES)
    model = build_model(cfg, seed=0, dtype=getattr(torch, job["dtype"])).eval()
    start = time.perf_counter()
    llm = LLM(model, load_tokenizer("byte"), compile=not job["dry_run"])
    startup = time.perf_counter() - start
    prompt = torch.randint(0, cfg.vocab_size, (1, job["prompt_len"]), generator=torch.Generator().manual_seed(0))

    def run(new):
        llm.generate(prompt.tolist(), SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))

    def per_token_ms() -> list[float]:
        run(4)  # warm-up, and the prompt into the prefix cache for every timed run alike
        times = []
        for _ in range(job["trials"]):
            begin = time.perf_counter()
            run(1)
            one = time.perf_counter() - begin
            begin = time.perf_counter()
            run(job["new"])
            times.append(1000 * (time.perf_counter() - begin - one) / (job["new"] - 1))
        return times

    return {"threads": torch.get_num_threads(), "threads_why": threads_why, "wait_why": wait_why,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"), "startup_s": startup,
            "ms": per_token_ms(), "load_average": load_average()}


def run_worker(job: dict, out_dir: Path) -> dict:
    path = out_dir / "serve_load_job.json"
    path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, __file__, "--worker", str(path)], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"worker for {job['label']!r} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith(RESULT))
    return json.loads(line.removeprefix(RESULT))


# ------------------------------------------------------------------------------------------- main
def cell(phase: dict) -> str:
    ms = phase["ms"]
    return f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) @ load {phase['load_average']:.1f}"


def ratio(quiet: dict, loaded: dict) -> str:
    return f"{statistics.median(loaded['ms']) / statistics.median(quiet['ms']):.2f}×"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy", type=int, default=2, help="busy-loop processes of the background load")
    p.add_argument("--load-seconds", type=float, default=240,
                   help="each busy loop ends by itself after this long, if nothing killed it first")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dry-run", action="store_true", help="tiny model, eager engine, 4 new tokens, 1 trial")
    p.add_argument("--out-dir", default="/tmp", help="where the job file for the children goes")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    if sys.argv[1:2] == ["--worker"]:  # before machine.py imports torch: the worker sets OpenMP's policy first
        print(RESULT + json.dumps(worker(json.loads(Path(sys.argv[2]).read_text()))), flush=True)
        return
    from machine import dtype_arg, machine_header  # benchmarks/machine.py

    dtype_arg(p)
    args = p.parse_args()
    if args.new_tokens < 2 or args.trials < 1 or args.busy < 1:
        p.error("--new-tokens must be at least 2, --trials and --busy at least 1")
    from seekforge.config import preset

    cfg = preset("tiny", **DRY_OVERRIDES) if args.dry_run else preset("small", **MODEL_OVERRIDES)
    dtype, _ = machine_header(args.dtype, probe_peak=False, hidden_size=cfg.hidden_size)
    new, trials, prompt_len = (4, 1, 16) if args.dry_run else (args.new_tokens, args.trials, 128)
    print(f"model: {'tiny' if args.dry_run else 'serve_peers'} ({cfg.num_params()['total'] / 1e6:.1f}M parameters), "
          f"{'eager' if args.dry_run else 'compiled'} engine, batch-1 decode of {new} tokens after a "
          f"{prompt_len}-token prompt, {trials} trials; background load: {args.busy} busy loops; "
          f"{os.cpu_count()} cores, load average {load_average():.1f} at start")
    results = {}
    for label, wait, threads in ROWS:
        job = {"label": label, "wait": wait, "threads": threads, "dtype": str(dtype).split(".")[-1],
               "dry_run": args.dry_run, "prompt_len": prompt_len, "new": new, "trials": trials}
        results[label] = {}
        for phase in ("quiet", "loaded"):
            load = background_load(args.busy, args.load_seconds) if phase == "loaded" else contextlib.nullcontext()
            with load:
                results[label][phase] = r = run_worker(job, Path(args.out_dir))
            print(f"{label}, {phase}: {r['threads']} threads ({r['threads_why']}); {r['wait_why']}; engine built in "
                  f"{r['startup_s']:.0f} s; {cell(r)} ms/token", flush=True)
    print_table(results)


def print_table(results: dict) -> None:
    print("\n| configuration | threads | OMP_WAIT_POLICY quiet / loaded | quiet ms/token | loaded ms/token | "
          "loaded / quiet |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        quiet, loaded = r["quiet"], r["loaded"]
        print(f"| {label} | {quiet['threads']} | {quiet['omp_wait_policy']} / {loaded['omp_wait_policy']} | "
              f"{cell(quiet)} | {cell(loaded)} | {ratio(quiet, loaded)} |")
    ours = results["seekforge policy"]
    for phase in ("quiet", "loaded"):
        print(f"seekforge policy {phase}: " + ", ".join(
            f"{ratio(r[phase], ours[phase])} the time of {label}" for label, r in results.items()
            if label != "seekforge policy"))
    print("(vLLM's CPU build took 1.5× its quiet time under a load average of 7-9 from other users; issue 41)")


if __name__ == "__main__":
    main()
