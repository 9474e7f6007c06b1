"""Multi-step scheduling (num_scheduler_steps = N): outputs equal N = 1's — greedy and seeded sampling,
with prompts that prefill while others decode, eos / stop strings / max_tokens stopping inside the N
steps — every output still streams one token at a time, and a stopped sequence's slots are freed."""

from __future__ import annotations

import pytest
import torch

from seekforge.serve.engine import LLM
from seekforge.serve.runner import Runner
from seekforge.serve.sequence import SamplingParams

MAX_NEW = 20


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 30, 64, 12, 3)]


def generate(model, tokenizer, prompts, params, steps, **kwargs):
    llm = LLM(model, tokenizer, block_size=8, num_kv_blocks=96, max_num_batched_tokens=32,
              num_scheduler_steps=steps, **kwargs)
    outs = llm.generate(prompts, params)
    assert llm.engine.block_manager.num_free_blocks == 96
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=1.3, ignore_eos=True),  # N = 1 path
], ids=["greedy", "seeded", "penalties"])
def test_equals_single_step(tiny_model, byte_tokenizer, prompts, params, monkeypatch):
    calls = []
    decode_steps = Runner.decode_steps
    monkeypatch.setattr(Runner, "decode_steps", lambda self, *a: calls.append(a[1]) or decode_steps(self, *a))
    ref = generate(tiny_model, byte_tokenizer, prompts, params, 1)
    out = generate(tiny_model, byte_tokenizer, prompts, params, 8)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.text for o in out] == [o.text for o in ref]
    if params.logprobs is not None:
        for o, r in zip(out, ref, strict=True):
            torch.testing.assert_close([x["logprob"] for x in o.logprobs], [x["logprob"] for x in r.logprobs])
    if params.has_penalties:
        assert not calls  # penalties read the output after every token: single steps only
    else:
        assert calls and max(calls) == 8


def test_stops_inside_the_steps(tiny_model, byte_tokenizer, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ref = generate(tiny_model, byte_tokenizer, prompts, greedy, 1)
    # per prompt: stop on its 6th token (a token id), on a string from its text, or at max_tokens=5
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[r.token_ids[5]]) for r in ref[:2]]
    params += [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[r.text[6:8]]) for r in ref[2:4] if r.text[6:8]]
    params += [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    chosen = prompts[:len(params) - 1] + prompts[-1:]
    ref = generate(tiny_model, byte_tokenizer, chosen, params, 1)
    out = generate(tiny_model, byte_tokenizer, chosen, params, 8)
    def summary(outs):
        return [(o.token_ids, o.text, o.finish_reason) for o in outs]

    assert summary(out) == summary(ref)
    assert [o.finish_reason for o in out[:2]] == ["stop", "stop"] and len(out[-1].token_ids) == 5


def test_streams_one_token_per_output(tiny_model, byte_tokenizer):
    llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=32, num_scheduler_steps=8)
    engine = llm.engine
    request_id = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))
    lengths = []
    while engine.has_unfinished():
        lengths += [len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == request_id]
    assert lengths == list(range(1, 18))
    assert engine.num_steps == 17


def test_cannot_combine_with_speculative_decoding():
    from seekforge.config import EngineConfig

    with pytest.raises(ValueError, match="cannot be combined"):
        EngineConfig(speculative_tokens=2, num_scheduler_steps=4)
