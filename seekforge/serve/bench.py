"""`seekforge bench serve`: load-test a running OpenAI-compatible server, like `vllm bench serve`.

N streaming /v1/completions requests from a dataset — `random` (random token ids) or `shared-prefix`
(every prompt = one common prefix + a random suffix, to exercise prefix caching) — sent at a Poisson
request rate or as fast as `--max-concurrency` allows. Output lengths are pinned with
ignore_eos + min_tokens so every run generates the same number of tokens.

Reports: request and token throughput; TTFT (time to first token), TPOT (time per output token after
the first, per request) and ITL (gap between streamed chunks) as mean / median / p99 in ms.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from seekforge.errors import UserError


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(dataset: str, num_prompts: int, input_len: int, prefix_len: int, vocab: int,
                 seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if dataset == "random":
        return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    if dataset == "shared-prefix":
        if not 0 < prefix_len < input_len:
            raise ValueError(f"--prefix-len={prefix_len} must be in (0, --input-len={input_len})")
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        return [prefix + [rng.randrange(vocab) for _ in range(input_len - prefix_len)] for _ in range(num_prompts)]
    raise ValueError(f"--dataset {dataset!r}: choose 'random' or 'shared-prefix'")


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def run_benchmark(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                        request_rate: float = float("inf"), max_concurrency: int | None = None,
                        api_key: str | None = None, seed: int = 0) -> dict:
    """Send every prompt, wait for all; return the summary dict that `print_summary` shows."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts))
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:

        async def limited(prompt):
            async with limit:
                body = {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
                        "ignore_eos": True, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                return await _one(client, "/v1/completions", body)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": 1000 * statistics.fmean(values), "median": 1000 * statistics.median(values),
            "p99": 1000 * p99}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration, "output_token_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
    }


def print_summary(s: dict) -> None:
    print(f"{' Serving Benchmark Result ':=^56}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_token_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}")]
    for name in ("ttft", "tpot", "itl"):
        st = s[f"{name}_ms"]
        rows += [(f"Mean {name.upper()} (ms)", f"{st['mean']:.2f}"), (f"Median {name.upper()} (ms)",
                 f"{st['median']:.2f}"), (f"P99 {name.upper()} (ms)", f"{st['p99']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v:>16}")
    for e in s["errors"]:
        print(f"error: {e}")
    print("=" * 56)


def add_arguments(p):
    p.add_argument("what", choices=["serve"], help="what to benchmark (a running server)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's address, without /v1 (a trailing /v1 is dropped)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it set one")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random",
                   help="random token prompts, or prompts sharing a --prefix-len prefix (prefix caching)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="tokens each request generates (ignore_eos)")
    p.add_argument("--prefix-len", type=int, default=64, help="shared-prefix: tokens common to all prompts")
    p.add_argument("--vocab", type=int, default=256, help="random token ids are drawn from [0, vocab)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once (None: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument("--result-json", default=None, help="also write the summary here")


def run(args):
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate {args.request_rate}: give requests/s > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: give at least 1 (or leave it out: no limit)")
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")  # the openai client's form of the address
    model = args.model
    if model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        url = f"{args.base_url}/v1/models"
        try:
            response = httpx.get(url, headers=headers, timeout=30)
        except httpx.HTTPError as e:
            raise ValueError(f"could not reach {url} ({e}); is the server running? Start it with `seekforge "
                             "serve`, or pass --base-url") from e
        if response.status_code == 401:
            raise ValueError(f"{url}: 401, the server wants an API key; pass its key with --api-key")
        try:
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise ValueError(f"could not list models at {url} (HTTP {response.status_code}: "
                             f"{response.text[:200]}); is --base-url an OpenAI-compatible server? Or pass "
                             "--model") from e
    prompts = make_prompts(args.dataset, args.num_prompts, args.input_len, args.prefix_len, args.vocab, args.seed)
    summary = asyncio.run(run_benchmark(args.base_url, model, prompts, args.output_len, args.request_rate,
                                        args.max_concurrency, args.api_key, args.seed))
    print_summary(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    if summary["completed"] == 0:  # nothing was measured: a script must not read the zeros as a result
        raise UserError(f"all {summary['failed']} requests failed: "
                        f"{summary['errors'][0]}; fix that (see the server's log) and rerun")
