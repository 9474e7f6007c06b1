"""Tool calls in DeepSeek-V3's format (serve/tools.py): parsing real DeepSeek-format text, streaming
deltas, and the server through the official `openai` client (named / required tool_choice forced by
a grammar; `auto` parses whatever the model wrote, here forced to real DeepSeek text)."""

from __future__ import annotations

import dataclasses
import json
import random

import jsonschema
import openai
import pytest

from seekforge.config import EngineConfig, preset
from seekforge.model.model import build_model
from seekforge.serve.structured import GrammarCompiler, StructuredOutput
from seekforge.serve.tools import (
    CALL_END,
    CALLS_BEGIN,
    ToolCallStream,
    format_tool_calls,
    messages_for_template,
    parse_tool_calls,
    tool_call_grammar,
)

from .conftest import serving

# As DeepSeek-V3's chat template writes two calls (tool call markers are its special tokens' text).
DEEPSEEK_TEXT = (
    "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
    'get_time\n```json\n{"tz": "Europe/Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}}, "required": ["tz"],
        "additionalProperties": False}}},
]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(byte_tokenizer):
    """The tiny preset with a 2048-token context: the tool list in the prompt is ~800 byte tokens."""
    model = build_model(dataclasses.replace(preset("tiny"), max_position_embeddings=2048), seed=0).eval()
    with serving(model, byte_tokenizer, EngineConfig(num_kv_blocks=1024, block_size=16,
                                                     max_num_batched_tokens=1024)) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_deepseek_text():
    content, calls = parse_tool_calls(DEEPSEEK_TEXT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    unfinished = DEEPSEEK_TEXT[:120]  # cut inside the first call: no call, all text stays content
    assert parse_tool_calls(unfinished) == (unfinished, [])


def test_format_round_trips_and_messages_render():
    calls = [{"type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]
    assert [c["function"] for c in parse_tool_calls(format_tool_calls(calls))[1]] == [calls[0]["function"]]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    rendered = messages_for_template(history, TOOLS)
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert rendered[2]["content"] == format_tool_calls(calls) and "tool_calls" not in rendered[2]


@pytest.mark.parametrize("seed", range(5))
def test_stream_deltas_add_up(seed):
    """However the text arrives, the content deltas and tool_call deltas rebuild the parse."""
    rng = random.Random(seed)
    stream, cuts = ToolCallStream(), sorted(rng.sample(range(1, len(DEEPSEEK_TEXT)), 25))
    content, calls = "", {}
    for end in [*cuts, len(DEEPSEEK_TEXT)]:
        text, deltas = stream.update(DEEPSEEK_TEXT[:end], final=end == len(DEEPSEEK_TEXT))
        content += text
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d.get("function", {}).get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments", "")
    want_content, want_calls = parse_tool_calls(DEEPSEEK_TEXT)
    assert content == want_content
    assert [calls[k] for k in sorted(calls)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in want_calls]


def check_calls(tool_calls, names):
    assert [c.function.name for c in tool_calls] == names
    for c in tool_calls:
        assert c.type == "function" and c.id
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])


def accumulate(chunks):
    """What an OpenAI streaming client does with tool_calls deltas."""
    calls, content, finish = {}, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return content, [calls[k] for k in sorted(calls)], finish


def test_named_tool_choice_forces_a_valid_call(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, n=2,
                                       max_tokens=400, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        check_calls(choice.message.tool_calls, ["get_weather"])
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                            max_tokens=400, stream=True, tool_choice={
                                                "type": "function", "function": {"name": "get_time"}})
    content, calls, finish = accumulate(stream)
    assert content == "" and finish == "tool_calls" and [c["name"] for c in calls] == ["get_time"]
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA["get_time"])


def test_required_calls_one_of_the_tools(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, n=2, max_tokens=400)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].function.name in SCHEMA
        check_calls(choice.message.tool_calls, [choice.message.tool_calls[0].function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_grammar_takes_deepseek_calls(byte_tokenizer, parallel):
    """The grammar for required/named accepts DeepSeek's own text: both calls only when parallel."""
    matcher = GrammarCompiler(byte_tokenizer, 512).matcher(StructuredOutput(grammar=tool_call_grammar(TOOLS, parallel)))
    calls = DEEPSEEK_TEXT[DEEPSEEK_TEXT.index(CALLS_BEGIN):].replace('": "', '":"').replace('", "', '","')  # compact
    accepted = matcher.try_consume_tokens(byte_tokenizer.encode(calls))
    assert (accepted == len(calls.encode()) and matcher.is_stopped()) == parallel
    first_call_end = calls.index(CALL_END) + len(CALL_END)
    assert accepted >= len(calls[:first_call_end].encode())  # the first call is fine either way


def test_auto_parses_what_the_model_wrote(client):
    """The model's output forced to the real DeepSeek text (a guided choice), parsed by the auto path."""
    force = {"guided_choice": [DEEPSEEK_TEXT]}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                       max_tokens=600, extra_body=force)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    check_calls(message.tool_calls, ["get_weather", "get_time"])
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = accumulate(client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=600, stream=True, extra_body=force))
    assert content == "Let me check." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    # tool_choice none: a call in the output is plain content
    call = format_tool_calls([{"type": "function", "function": {"name": "get_time", "arguments": '{"tz":"UTC"}'}}])
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=600, extra_body={"guided_choice": [call]})
    assert r.choices[0].message.content == call and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_history_goes_through_the_template(client):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens > 200  # the tool list and the earlier call are in the prompt
