"""The server under abuse: limits answered as 400s naming the limit, overload as 503 + Retry-After,
a client that stops reading does not stall the others, and a soak of concurrent clients (valid,
hanging up, malformed) gets no 5xx and leaks no KV block; SIGTERM then drains and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import time

import httpx
import pytest

from seekforge.config import EngineConfig
from seekforge.serve.limits import LimitsMiddleware, ServerLimits
from tests.serve.conftest import LiveServer, free_port

from .conftest import python, subprocess_env
from .soak import soak


@contextlib.contextmanager
def guarded_server(model, tokenizer, limits: ServerLimits, **engine):
    from seekforge.serve.async_engine import AsyncEngine
    from seekforge.serve.engine import LLMEngine
    from seekforge.serve.server import build_app

    async_engine = AsyncEngine(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=256, block_size=8, **engine)))
    server = LiveServer(LimitsMiddleware(build_app(async_engine, "tiny"), limits))
    server.engine = async_engine
    try:
        yield server
    finally:
        server.stop()
        async_engine.shutdown()


def test_limits_are_400s_naming_the_limit(tiny_model, byte_tokenizer):
    with guarded_server(tiny_model, byte_tokenizer, ServerLimits(max_body_bytes=4096, max_n=4)) as s:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            cases = [({"model": "tiny", "prompt": "x" * 5000}, "at most 4096"),
                     ({"model": "tiny", "prompt": "x", "n": 5}, "limit of 4"),
                     ({"model": "tiny", "prompt": ["a", "b", "c"], "n": 2}, "3 prompts × n=2"),
                     ({"model": "tiny", "prompt": "x" * 600, "max_tokens": 1}, "context length is 512"),
                     ({"model": "tiny", "prompt": "x", "max_tokens": 600}, "512")]
            for body, says in cases:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 400 and says in r.json()["error"]["message"], (body, r.text)
            nested = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # ~2 KB
            r = c.post("/v1/completions", content=nested, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "too deeply" in r.json()["error"]["message"], r.text
            assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200


def test_overload_is_a_503_with_retry_after(tiny_model, byte_tokenizer):
    limits = ServerLimits(max_concurrent=1, max_queue=1, queue_timeout_s=0.5)
    with guarded_server(tiny_model, byte_tokenizer, limits) as s:
        async def burst():
            async with httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
                body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert codes[0] == 200 and 503 in codes, codes
        busy = next(r for r in responses if r.status_code == 503)
        assert int(busy.headers["retry-after"]) >= 1 and "overloaded" in busy.json()["error"]["message"]
        stats = s.engine.engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]


def test_a_client_that_stops_reading_does_not_stall_others(tiny_model, byte_tokenizer):
    with guarded_server(tiny_model, byte_tokenizer, ServerLimits()) as s:
        async def scenario():
            async with httpx.AsyncClient(base_url=s.base_url, timeout=120) as c:
                body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as stalled:
                    assert stalled.status_code == 200  # headers read; the body is never read
                    quick = {"model": "tiny", "prompt": "y", "max_tokens": 4}
                    others = await asyncio.gather(*(c.post("/v1/completions", json=quick) for _ in range(5)))
                    return [r.status_code for r in others]

        assert asyncio.run(scenario()) == [200] * 5


# ------------------------------------------------------------------------------ soak + SIGTERM
def _start_server(port: int, grace: float) -> subprocess.Popen:
    cmd = [python(), "-m", "seekforge.cli", "serve", "--model", "tiny", "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory", "32MiB", "--threads", "1", "--log-level", "warning", "--shutdown-grace", str(grace)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def _gauges(base_url: str) -> dict:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(seekforge_\w+) ([0-9.e+-]+)$", text, re.M)}


def _wait_idle(base_url: str) -> dict:
    """The engine's gauges once nothing runs or waits (aborts are processed on the engine's next step)."""
    deadline = time.monotonic() + 60
    while True:
        g = _gauges(base_url)
        if g["seekforge_num_requests_running"] == 0 and g["seekforge_num_requests_waiting"] == 0 \
                and g["seekforge_kv_cache_usage_ratio"] == 0 or time.monotonic() > deadline:
            return g
        time.sleep(0.2)


async def _streams_then_sigterm(base_url: str, proc: subprocess.Popen, count: int) -> list[list[str]]:
    """`count` long streams; SIGTERM once each has produced a token; the last two data lines of each."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
        started = asyncio.Event()
        ready = 0

        async def stream():
            nonlocal ready
            body = {"model": "tiny", "prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}
            lines = []
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        if not lines:
                            ready += 1
                            if ready == count:
                                started.set()
                        lines = [*lines[-1:], line]
            return lines

        tasks = [asyncio.create_task(stream()) for _ in range(count)]
        await asyncio.wait_for(started.wait(), 60)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        await asyncio.sleep(0.3)
        try:  # admission has stopped: a 503, or the listening socket is already closed
            late = (await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})).status_code
        except httpx.TransportError:
            late = "refused"
        return sent, late, await asyncio.gather(*tasks)


def run_soak_and_drain(clients: int, seed: int = 0) -> dict:
    port, grace = free_port(), 1.0
    base_url = f"http://127.0.0.1:{port}"
    proc = _start_server(port, grace)
    try:
        seen = asyncio.run(soak(base_url, clients, seed))
        gauges = _wait_idle(base_url)
        sigterm_at, late, lasts = asyncio.run(_streams_then_sigterm(base_url, proc, 3))
        code = proc.wait(timeout=60)
        return {"seen": seen, "gauges": gauges, "lasts": lasts, "exit": code, "late": late,
                "sigterm_to_exit_s": time.monotonic() - sigterm_at, "log": proc.stdout.read()}
    finally:
        if proc.poll() is None:
            proc.kill()


def _check(result: dict, clients: int) -> None:
    seen, gauges = result["seen"], result["gauges"]
    engine = {k: v for k, v in gauges.items() if k.endswith(("running", "waiting", "usage_ratio"))}
    print(json.dumps({**{k: v for k, v in sorted(seen.items()) if ":" not in k}, "exit": result["exit"],
                      "request after SIGTERM": result["late"],
                      "sigterm_to_exit_s": round(result["sigterm_to_exit_s"], 2), **engine}, indent=1))
    assert seen["status>=500"] == 0, seen
    assert sum(v for k, v in seen.items() if k.startswith(("valid", "hang-up", "malformed "))) == clients
    assert set(k for k in seen if k.startswith("valid ")) == {"valid 200"}, seen
    assert all(400 <= int(k.split()[1]) < 500 for k in seen if k.startswith("malformed ")), seen
    assert gauges["seekforge_kv_cache_usage_ratio"] == 0 and gauges["seekforge_num_requests_running"] == 0, gauges
    for last in result["lasts"]:  # cut by the drain: a final error event, then [DONE]
        assert last[-1] == "data: [DONE]" and "shut down before this request finished" in last[0], last
    assert result["late"] in (503, "refused"), result["late"]
    assert result["exit"] == 0, result["log"][-3000:]


def test_soak_then_sigterm_drain():
    _check(run_soak_and_drain(60, seed=1), 60)


@pytest.mark.slow
def test_soak_500_clients_then_sigterm_drain():
    _check(run_soak_and_drain(500, seed=0), 500)
