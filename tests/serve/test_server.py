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
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams

from .conftest import serving


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model, byte_tokenizer):
    """The same model in an offline engine: what the server must return, token for token."""
    return LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_models_and_health(client, live_server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(live_server.base_url + "/health").json() == {"status": "ok"}


def test_completion_greedy_matches_engine(client, offline):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    ref = offline.generate("Hello", greedy(6, logprobs=0))[0].outputs[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    # the same tokens: each chosen token's logprob equals the engine's
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-5)
    # 5 bytes, no BOS: the byte tokenizer's models train without one (add_bos_token False)
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # 5 tokens fill no block of 8: nothing to reuse


def test_logprob_tokens_keep_their_bytes(client):
    """A byte token that is part of a character reads "bytes:\\xNN" (OpenAI's way), so distinct tokens stay
    distinct; chat's `bytes` are the token's own; text_offset counts characters of the text."""
    r = client.completions.create(model="tiny", prompt="héllo", max_tokens=0, echo=True, logprobs=1)
    logprobs = r.choices[0].logprobs
    assert logprobs.tokens == ["h", "bytes:\\xc3", "bytes:\\xa9", "l", "l", "o"]
    assert logprobs.text_offset == [0, 1, 1, 2, 3, 4] and r.choices[0].text == "héllo"
    assert r.usage.completion_tokens == 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "é"}], max_tokens=3,
                                          logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    for entry in chat.choices[0].logprobs.content:
        for top in [entry, *entry.top_logprobs]:
            token = top.token
            assert bytes(top.bytes) == (bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:")
                                        else token.encode())


def test_prefix_cache_reported_as_cached_tokens(client):
    prompt = list(range(40))
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 32  # 4 full blocks of 8; the last token recomputes


def test_chat_completion(client, offline):
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ref = offline.chat(messages, greedy(4, logprobs=2))[0]
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 4
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [e["logprob"] for e in ref.outputs[0].logprobs], abs=1e-5)
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_n_greater_than_one(client):
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=5, n=3, temperature=1.0, seed=1,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                       max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: both the same


def test_multiple_prompts(client, offline):
    r = client.completions.create(model="tiny", prompt=["a", "bb"], max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = offline.generate(["a", "bb"], greedy(2))
    assert [(c.index, c.text) for c in sorted(r.choices, key=lambda c: c.index)] == \
        [(0, ref[0].outputs[0].text), (1, ref[1].outputs[0].text)]
    assert r.usage.prompt_tokens == 1 + 2 and r.usage.completion_tokens == 4  # bytes, no BOS


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
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert chunks[-1].usage.completion_tokens == 5


def test_continuous_usage_stats(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    chunks = list(client.completions.create(
        model="tiny", prompt="count", max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    content = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in content] == [1, 2, 3, 4, 5]  # one chunk per token
    assert all(c.usage.prompt_tokens == 5 and c.usage.total_tokens == 5 + c.usage.completion_tokens
               for c in content)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 10
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert len(roles) == 2 and all(c.usage.completion_tokens == 0 for c in roles)
    assert [c.usage.completion_tokens for c in chunks[2:-1]] == [1, 2, 3, 4, 5, 6]  # 2 choices x 3 tokens
    last, final = chunks[-2].usage, chunks[-1].usage  # the last content chunk's usage is the request's
    assert (last.prompt_tokens, last.completion_tokens, last.total_tokens) == \
        (final.prompt_tokens, final.completion_tokens, final.total_tokens)
    plain = list(client.completions.create(model="tiny", prompt="count", max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])  # only asked for the final usage


def test_stop_strings(client, offline, byte_tokenizer):
    free = offline.generate([65, 66], greedy(16))[0].outputs[0]
    # a stop string spanning two tokens, of plain characters (no U+FFFD: those can wait for more bytes)
    cut = next((i for i in range(1, len(free.text) - 1) if free.text[i:i + 2].isascii()), None)
    assert cut is not None, f"the seeded tiny model's output {free.text!r} has no two ASCII characters in a row"
    stop = free.text[cut:cut + 2]
    cut = free.text.find(stop)
    # generation ends at the token that completes the stop string
    num_tokens = next(k for k in range(1, 17) if stop in byte_tokenizer.decode(free.token_ids[:k]))
    kw = dict(model="tiny", prompt=[65, 66], max_tokens=16, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == free.text[:cut]
    assert r.usage.completion_tokens == num_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == free.text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -3}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x" * 600}).encode(), "context length"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 600}).encode(), "context length"),
    (json.dumps({"model": "tiny", "prompt": "x", "frobnicate": 1}).encode(), "unsupported parameter"),
    (json.dumps({"model": "tiny", "prompt": "x", "suffix": "y"}).encode(), "suffix"),
    (json.dumps({"model": "tiny", "prompt": "x", "logit_bias": {"1": 2}}).encode(), "logit_bias"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": -1}).encode(), "temperature"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
    (json.dumps({"model": "tiny", "prompt": "x", "top_k": -5}).encode(), "top_k"),
    (json.dumps({"model": "tiny", "prompt": "x", "seed": 10**20}).encode(), "seed"),
    (json.dumps({"model": "tiny"}).encode(), "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}).encode(),
     "only allowed with stream=true"),
    (json.dumps({"model": "tiny", "prompt": "x", "stream": True,
                 "stream_options": {"continuous_usage_stats": True}}).encode(), "needs include_usage=true"),
])
def test_errors_are_openai_400s(live_server, body, message):
    r = httpx.post(live_server.base_url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    if message == "not valid JSON":
        assert error["param"] is None  # not pydantic's position in the text
    if message in ("max_tokens", "temperature", "top_k", "seed", "suffix", "logit_bias"):  # the field by name
        assert error["param"] == message


def chat_body(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("url, body, message", [
    ("completions", {"model": "tiny", "prompt": "\ud800abc"}, "lone surrogate"),
    ("completions", {"model": "tiny", "prompt": ["ok", "\udc00"]}, "lone surrogate"),
    ("chat/completions", chat_body(messages=[{"role": "user", "content": "\udc00hi"}]), "lone surrogate"),
    ("chat/completions", chat_body(messages=[{"role": "assistant", "content": None, "tool_calls": "x"}]),
     "messages.0.tool_calls"),
    ("chat/completions", chat_body(messages=[{"role": "assistant", "tool_calls": [{"id": "c1"}]}]),
     "messages.0.tool_calls.0.function"),
    ("chat/completions", chat_body(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]),
     "arguments"),
    ("chat/completions", chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}],
                                   tool_choice="required"), "tools.0.function.parameters"),
    ("chat/completions", chat_body(tools=[{"type": "function", "function": {"name": 5}}]), "tools.0.function.name"),
    ("chat/completions", chat_body(tools=[TOOL, TOOL]), "more than once"),
    ("chat/completions", chat_body(response_format={"type": "json_schema", "json_schema": "x"}), "json_schema.schema"),
    ("chat/completions", chat_body(structured_outputs={"choice": "abc"}), "choice must be"),
    ("chat/completions", chat_body(max_completion_tokens=0), "max_completion_tokens=0"),
    ("tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f"}}]},
     "tools.0.type"),
    ("tokenize", {"prompt": "\ud800"}, "lone surrogate"),
])
def test_malformed_fields_are_400s_naming_them(live_server, url, body, message):
    """Fields the handlers read (tool calls in the history, tools, response_format, text) are checked as they come
    in: a 400 naming the field, where each of these was a 500 from deep inside."""
    path = url if url == "tokenize" else "v1/" + url
    r = httpx.post(f"{live_server.base_url}/{path}", content=json.dumps(body),  # ASCII JSON: a surrogate escaped
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b"null"])
def test_a_body_that_is_no_json_object_says_so(live_server, body):
    for headers in ({"content-type": "application/json"}, {}):  # plain `curl -d` sends no JSON content type
        r = httpx.post(live_server.base_url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"], r.text


def test_errors_through_openai_client(client):
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:  # OpenAI: 404 model_not_found
        client.completions.create(model="nope", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
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
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = httpx.get(live_server.base_url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    client.completions.create(model="tiny", prompt="m", max_tokens=3, extra_body={"ignore_eos": True})
    after = scrape()

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("seekforge_prompt_tokens_total") == 1 and grew("seekforge_generation_tokens_total") == 3
    assert grew("seekforge_requests_total", finish_reason="length") == 1
    assert grew("seekforge_time_to_first_token_seconds_count") == 1
    assert grew("seekforge_time_per_output_token_seconds_count") == 1
    for gauge in ("seekforge_num_requests_running", "seekforge_num_requests_waiting",
                  "seekforge_kv_cache_usage_ratio", "seekforge_prefix_cache_hit_rate", "seekforge_num_preemptions"):
        assert (gauge, ()) in after


def test_api_key(tiny_model, byte_tokenizer):
    with serving(tiny_model, byte_tokenizer, EngineConfig(num_kv_blocks=32, block_size=8), api_key="sekrit") \
            as server:
        bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=server.base_url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).choices
        for scheme, status in (("bearer", 200), ("BEARER", 200), ("Basic", 401)):  # the scheme in any case
            r = httpx.get(server.base_url + "/v1/models", headers={"authorization": f"{scheme} sekrit"})
            assert r.status_code == status, scheme
        assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key


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
