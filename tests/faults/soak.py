"""Many concurrent clients against a live server: valid requests (plain, streamed, chat), clients
that hang up mid-request, and malformed requests, in a seeded random mix. Returns what happened,
so the tests (and RELIABILITY.md) can count it."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx

MODEL = "tiny"

# (name, method, path, body or raw bytes): each must be a 4xx, never a 5xx.
MALFORMED = [
    ("invalid json", "POST", "/v1/completions", b"{not json"),
    ("json array", "POST", "/v1/completions", b"[1, 2]"),
    ("empty body", "POST", "/v1/completions", b""),
    ("binary garbage", "POST", "/v1/completions", bytes(range(256)) * 4),
    ("max_tokens not a number", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "lots"}),
    ("negative max_tokens", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}),
    ("huge max_tokens", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}),
    ("prompt beyond context", "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1}),
    ("n too large", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 1000}),
    ("unknown parameter", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}),
    ("wrong model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}),
    ("missing prompt", "POST", "/v1/completions", {"model": MODEL}),
    ("negative temperature", "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}),
    ("body too large", "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)}),
    ("chat without messages", "POST", "/v1/chat/completions", {"model": MODEL}),
    ("chat messages not a list", "POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
    ("GET on a POST route", "GET", "/v1/completions", None),
    ("no such route", "POST", "/v1/nothing", {"model": MODEL}),
]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "1+1=", "2"]) for _ in range(rng.randint(1, 30)))


async def _valid(client, rng, kind: str) -> int:
    if kind == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": _prompt(rng)}],
                "max_tokens": rng.randint(1, 12)}
        return (await client.post("/v1/chat/completions", json=body)).status_code
    body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": rng.randint(1, 12), "temperature": rng.random()}
    if kind == "plain":
        return (await client.post("/v1/completions", json=body)).status_code
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert r.status_code != 200 or lines[-1] == "data: [DONE]", lines[-3:]
        return r.status_code


async def _hang_up(client, rng) -> int:
    body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": 300, "ignore_eos": True}
    if rng.random() < 0.5:  # mid-stream, after the first token
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
            return r.status_code
    try:  # before the answer: the client gives up waiting
        await client.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5))
    except httpx.TimeoutException:
        return 0  # no response: the client left
    return -1  # finished before the client gave up (counted apart)


async def _malformed(client, rng) -> tuple[str, int]:
    name, method, path, body = rng.choice(MALFORMED)
    if body is None:
        r = await client.request(method, path)
    elif isinstance(body, bytes):
        r = await client.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.request(method, path, json=body)
    return name, r.status_code


async def soak(base_url: str, clients: int, seed: int = 0) -> Counter:
    """`clients` concurrent clients, one request each: 50% valid, 20% hang-ups, 30% malformed.
    Counter keys: "valid <status>", "hang-up <status>" (0: left before any response), "malformed <status>",
    "status>=500" for every 5xx, and "malformed:<name>" per kind sent."""
    rng = random.Random(seed)
    seen: Counter = Counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        async def one(i: int):
            r = random.Random(rng.random())
            roll = r.random()
            if roll < 0.5:
                status = await _valid(client, r, r.choice(["plain", "stream", "chat"]))
                seen[f"valid {status}"] += 1
            elif roll < 0.7:
                status = await _hang_up(client, r)
                seen[f"hang-up {status}"] += 1
            else:
                name, status = await _malformed(client, r)
                seen[f"malformed {status}"] += 1
                seen[f"malformed:{name}"] += 1
            if status >= 500:
                seen["status>=500"] += 1

        await asyncio.gather(*(one(i) for i in range(clients)))
    return seen
