"""Bounded load test: 200 concurrent streaming requests against a server whose KV cache cannot hold
them all at once (so requests queue and get preempted). All must complete with their full length,
and afterwards every block is free again."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from seekforge.config import EngineConfig
from seekforge.serve.bench import make_prompts, run_benchmark

from .conftest import serving

NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 200, 16, 8


@pytest.fixture(scope="module")
def small_cache_server(tiny_model, byte_tokenizer):
    # 160 blocks x 8 slots = 1280 tokens for 200 x 24 = 4800 tokens in flight
    config = EngineConfig(num_kv_blocks=160, block_size=8, max_num_seqs=128, max_num_batched_tokens=512)
    with serving(tiny_model, byte_tokenizer, config) as server:
        yield server


def test_200_concurrent_streams_complete_and_free_all_blocks(small_cache_server):
    async def one(client, i):
        body = {"model": "tiny", "prompt": [(i * 7 + k) % 256 for k in range(PROMPT_LEN)], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}
        usage = None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
        return usage

    async def main():
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        async with httpx.AsyncClient(base_url=small_cache_server.base_url, timeout=120, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS))), 150)

    usages = asyncio.run(main())
    assert len(usages) == NUM_REQUESTS
    assert all(u is not None and u["completion_tokens"] == MAX_TOKENS for u in usages)
    engine = small_cache_server.engine.engine
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)


def test_bench_serve_against_live_server(small_cache_server):
    prompts = make_prompts("shared-prefix", 12, input_len=32, prefix_len=24, vocab=256, seed=0)
    summary = asyncio.run(run_benchmark(small_cache_server.base_url, "tiny", prompts, output_len=4,
                                        max_concurrency=4))
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 48
    assert summary["ttft_ms"]["mean"] > 0 and summary["output_token_throughput"] > 0


def test_bench_serve_fails_when_every_request_fails(small_cache_server, capsys):
    """A benchmark of nothing is no result: `bench serve` ends with an error (exit 2) naming the failure,
    not exit 0 under a table of zeros (issue 41, bug 7)."""
    from seekforge.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--base-url", small_cache_server.base_url, "--model", "no-such-model",
              "--num-prompts", "3", "--input-len", "4", "--output-len", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "all 3 requests failed" in err and "HTTP 404" in err and "Traceback" not in err, err
