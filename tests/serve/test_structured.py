"""Structured output (serve/structured.py): llguidance token masks in sampling, through the engine and
the server (response_format, vLLM's guided_* and structured_outputs)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from seekforge.serve import LLM, SamplingParams
from seekforge.serve.structured import GrammarCompiler, StructuredOutput, allowed_tokens

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}, "label": {"enum": ["p", "q", None]}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1, "maxItems": 4},
]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_mask_allows_exactly_what_the_grammar_allows(byte_tokenizer):
    compiler = GrammarCompiler(byte_tokenizer, 512)
    matcher = compiler.matcher(StructuredOutput(regex="[ab]c"))
    assert allowed_tokens([matcher], 512)[0].nonzero()[:, 0].tolist() == [ord("a"), ord("b")]
    assert matcher.consume_token(ord("b"))
    assert allowed_tokens([matcher], 512)[0].nonzero()[:, 0].tolist() == [ord("c")]
    matcher.consume_token(ord("c"))
    # complete: only EOS; the model's padded ids past the tokenizer (259..511) are never allowed
    assert allowed_tokens([matcher], 512)[0].nonzero()[:, 0].tolist() == [byte_tokenizer.eos_token_id]
    assert matcher.is_stopped()


def test_100_sampled_json_schema_responses_validate(client):
    """Temperature 1 on a random model: without the mask almost nothing would parse. 4 schemas x n=25,
    each schema bounded (maxLength, maximum, maxItems, no extra properties) so that every response
    can finish within max_tokens; one that does not is reported as "length" (next test)."""
    results = []
    for schema in SCHEMAS:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "JSON please"}], n=25, temperature=1.0,
            max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        results += [(schema, c) for c in r.choices]
    assert len(results) == 100
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert len({c.message.content for _, c in results}) > 50  # sampled, not one forced answer


def test_cut_by_max_tokens_is_length(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=1.0, seed=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}})
    # 4 byte tokens of the only possible start: cut, incomplete, reported as such
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == '{"na'


def test_guided_fields_and_streaming(client):
    regex = client.completions.create(model="tiny", prompt="id:", max_tokens=20, temperature=1.0, n=5,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert all(len(c.text) == 6 and c.text[3] == "-" and c.finish_reason == "stop" for c in regex.choices)
    choices = ["yes", "no", 'it "depends"']
    picked = client.completions.create(model="tiny", prompt="?", max_tokens=20, temperature=1.0, n=8,
                                       extra_body={"guided_choice": choices})
    assert {c.text for c in picked.choices} <= set(choices)
    same = client.completions.create(model="tiny", prompt="?", max_tokens=20, temperature=1.0, n=4,
                                     extra_body={"structured_outputs": {"choice": choices}})
    assert {c.text for c in same.choices} <= set(choices)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=120, temperature=1.0, stream=True,
        extra_body={"guided_json": SCHEMAS[1]})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=60,
                                         temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, message", [
    ({"guided_regex": "(unclosed"}, "does not compile"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not several"),
    ({"response_format": {"type": "yaml"}}, "response_format type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "json_schema.schema"),
    ({"structured_outputs": {"xml": "<a/>"}}, "unsupported key"),
    ({"guided_choice": []}, "non-empty"),
])
def test_bad_constraints_are_400s(live_server, extra, message):
    r = httpx.post(live_server.base_url + "/v1/completions",
                   json={"model": "tiny", "prompt": "x", "max_tokens": 3, **extra})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_grammar_that_fails_while_generating_ends_as_abort(tiny_model, byte_tokenizer, caplog):
    """llguidance can compile a constraint and fail on its first token (this regex's lexer grows past its limit): the
    output is then no complete answer, so it ends "abort", with the library's error logged, not "stop"."""
    llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=10, structured=StructuredOutput(regex="a{100000000}"))
    with caplog.at_level("WARNING", logger="seekforge.serve"):
        out = llm.generate("x", params)[0].outputs[0]
    assert out.finish_reason == "abort" and out.text == "a"
    assert "too many expressions" in caplog.text


def test_each_of_n_sequences_advances_its_own_matcher(tiny_model, byte_tokenizer):
    """Seeded n=3 completions diverge; each still completes its own grammar (per-sequence state)."""
    llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64)
    out = llm.generate("x", SamplingParams(n=3, max_tokens=80, seed=1, structured=StructuredOutput(json=SCHEMAS[0])))
    texts = [c.text for c in out[0].outputs]
    assert len(set(texts)) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[0])


@pytest.mark.parametrize("engine", [{"speculative_tokens": 2}, {"num_scheduler_steps": 4}], ids=["spec", "multi-step"])
def test_constrained_sequence_beside_speculative_or_multi_step(tiny_model, byte_tokenizer, engine, monkeypatch):
    """One batch: a greedy request, a seeded regex-constrained one, a greedy one with prompt logprobs.
    Under speculative decoding (drafts that are partly right, so accepts happen) and under multi-step
    scheduling, all three equal the plain engine's outputs: the constrained sequence is never drafted
    for and never decodes multi-step (its matcher must see each token), the others still are/do."""
    from seekforge.serve.runner import Runner
    from seekforge.serve.spec_decode import SpecDecoder

    prompts = [list(b"ab"), list(b"id:"), list(b"score this prompt")]
    regex = "[0-9]{3}-[a-z]{2}"
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured=StructuredOutput(regex=regex)),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)]

    def run(**kwargs):
        llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64, **kwargs)
        return llm, llm.generate(prompts, params)

    _, ref = run()
    continuation = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref, strict=True)}
    mixed, drafted, multi = [], [], []

    def draw(self, seqs, logits):  # the reference continuation, every third draft wrong
        for seq in seqs:
            drafted.append(seq.matcher is not None)
            cont = continuation[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            i = seq.num_output_tokens + len(seq.draft_token_ids)
            token = cont[i] if i < len(cont) else 0
            seq.draft_token_ids.append((token + 1) % 256 if i % 3 == 2 else token)

    verify, decode_steps = SpecDecoder.verify, Runner.decode_steps
    monkeypatch.setattr(SpecDecoder, "_draw", draw)
    monkeypatch.setattr(SpecDecoder, "verify", lambda self, batch: mixed.append(
        any(s.matcher for s in batch.seqs) and any(s.draft_token_ids for s in batch.seqs)) or verify(self, batch))
    monkeypatch.setattr(Runner, "decode_steps", lambda self, seqs, *a: multi.append(
        any(s.matcher for s in seqs)) or decode_steps(self, seqs, *a))
    llm, outs = run(**engine)
    for out, r in zip(outs, ref, strict=True):
        assert out.outputs[0].token_ids == r.outputs[0].token_ids
    constrained = outs[1].outputs[0]
    assert re.fullmatch(regex, constrained.text) and constrained.finish_reason == "stop"
    assert len(outs[2].prompt_logprobs) == len(prompts[2]) and outs[2].prompt_logprobs[0] is None
    for got, want in zip(outs[2].prompt_logprobs[1:], ref[2].prompt_logprobs[1:], strict=True):
        assert got["token_id"] == want["token_id"] and got["rank"] == want["rank"]
        torch.testing.assert_close(got["logprob"], want["logprob"], atol=1e-4, rtol=0)
    if "speculative_tokens" in engine:
        assert any(mixed) and not any(drafted) and llm.engine.spec.num_accepted_tokens > 0
    else:
        assert multi and not any(multi)  # multi-step ran, only once the constrained sequence had finished
