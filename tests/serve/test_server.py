"""The server through the official `openai` client (and raw httpx for malformed requests), on
127.0.0.1 with the tiny preset."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from seekforge.config import EngineConfig
from seekforge.serve.engine import AsyncEngine, LLMEngine
from seekforge.serve.server import build_app

from .conftest import LiveServer


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(client, live_server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(live_server.base_url + "/health").json() == {"status": "ok"}


def test_completion_greedy_matches_engine(client, live_server):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 6  # bos + 5 bytes
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_prefix_cache_reported_as_cached_tokens(client):
    prompt = list(range(40))
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 32  # 4 full blocks of 8; the last token recomputes


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert len(choice.logprobs.content[0].top_logprobs) == 2


def test_n_greater_than_one(client):
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=5, n=3, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                       max_tokens=3, temperature=0)
    assert len(r.choices) == 2


def test_multiple_prompts(client):
    r = client.completions.create(model="tiny", prompt=["a", "bb"], max_tokens=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_streaming_with_usage(client):
    full = client.completions.create(model="tiny", prompt="stream me", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt="stream me", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens >= 1


def test_stop_strings(client):
    free = client.completions.create(model="tiny", prompt=[65, 66], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next((free[i:i + 1] for i in range(2, len(free)) if free[i:i + 1].isprintable()
                 and free[i:i + 1] not in free[:i]), None)
    if stop is None:
        pytest.skip("random weights produced no printable character to stop on")
    r = client.completions.create(model="tiny", prompt=[65, 66], max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == free[:free.find(stop)]
    chunks = list(client.completions.create(model="tiny", prompt=[65, 66], max_tokens=12, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == free[:free.find(stop)]


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), "does not exist"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -3}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x" * 600}).encode(), "context length"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 600}).encode(), "context length"),
    (json.dumps({"model": "tiny", "prompt": "x", "frobnicate": 1}).encode(), "unsupported parameter"),
    (json.dumps({"model": "tiny", "prompt": "x", "echo": True}).encode(), "echo"),
    (json.dumps({"model": "tiny", "prompt": "x", "logit_bias": {"1": 2}}).encode(), "logit_bias"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}).encode(), "temperature"),
    (json.dumps({"model": "tiny"}).encode(), "prompt"),
])
def test_errors_are_openai_400s(live_server, body, message):
    r = httpx.post(live_server.base_url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_errors_through_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    # the engine survived all of that
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=1).choices


def test_disconnect_aborts_and_frees_blocks(live_server):
    engine = live_server.engine.engine
    aborted = engine.num_aborted

    async def start_and_drop():
        async with httpx.AsyncClient(base_url=live_server.base_url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # got a token: hang up mid-stream

    asyncio.run(start_and_drop())
    assert_aborted_and_freed(engine, aborted)


def test_metrics(client, live_server):
    client.completions.create(model="tiny", prompt="m", max_tokens=3)
    text = httpx.get(live_server.base_url + "/metrics").text
    for name in ("seekforge_num_requests_running", "seekforge_num_requests_waiting",
                 "seekforge_kv_cache_usage_ratio", "seekforge_prefix_cache_hit_rate",
                 "seekforge_time_to_first_token_seconds_bucket", "seekforge_time_per_output_token_seconds_bucket"):
        assert name in text


def test_api_key(tiny_model, byte_tokenizer):
    engine = AsyncEngine(LLMEngine(tiny_model, byte_tokenizer, EngineConfig(num_kv_blocks=32, block_size=8)))
    server = LiveServer(build_app(engine, "tiny", api_key="sekrit"))
    try:
        bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).choices
        assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key
    finally:
        server.stop()
        engine.shutdown()


def test_non_streaming_disconnect_aborts(live_server):
    engine = live_server.engine.engine
    aborted = engine.num_aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.base_url + "/v1/completions", timeout=0.3,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 500, "ignore_eos": True})
    assert_aborted_and_freed(engine, aborted)


def assert_aborted_and_freed(engine, aborted_before: int):
    """The dropped request was aborted (within 20 s) and every KV block is free again."""
    deadline = time.monotonic() + 20
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_aborted == aborted_before + 1
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
