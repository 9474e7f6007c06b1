"""Engine equivalence: under greedy decoding (fp32) every completion equals the single-sequence
reference `generate`, token for token — batches of mixed lengths, chunked prefill on/off, prefix
caching on/off, and under preemption. Plus the engine's request-level behaviour."""

from __future__ import annotations

import copy

import pytest
import torch

from seekforge.model.generate import generate
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    lengths = (1, 5, 17, 33, 64, 120, 9)
    out = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    # prompts sharing a 40-token prefix, so the prefix cache has something to hit
    out += [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 20)]
    return out


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    return [generate(tiny_model, p, MAX_NEW) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_generate(tiny_model, byte_tokenizer, prompts, reference, chunked, prefix_caching):
    llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=128, enable_chunked_prefill=chunked,
              enable_prefix_caching=prefix_caching, max_num_batched_tokens=32 if chunked else 256)
    for _ in range(2):  # the second round runs with a warm prefix cache
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
    # the second round finds every full block of every prompt (the last token is always recomputed)
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [(len(p) - 1) // 8 * 8 if prefix_caching else 0 for p in prompts]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_equals_generate_under_preemption(tiny_model, byte_tokenizer, prompts, reference):
    # 24 blocks x 8 = 192 slots for ~420 tokens in flight: sequences get preempted and recomputed
    llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=24, max_num_batched_tokens=64)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24


@pytest.fixture(scope="module")
def llm(tiny_model, byte_tokenizer):
    return LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=128)


def test_prompts_as_text_or_ids(llm):
    by_text = llm.generate("hello", GREEDY)[0]
    by_ids = llm.generate([[*b"hello"]], GREEDY)[0]  # bytes; no BOS, as the byte tokenizer trains
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_n_and_seed_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    a = llm.generate("abc", params)[0]
    # same request inside a different batch: same tokens (per-sequence generators)
    b = llm.generate(["xyz", "abc", "another prompt"], params)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # completions differ from each other


class LetterTokenizer:
    """Every id decodes to one printable letter, so stop strings are found wherever we pick them."""

    bos_token_id, eos_token_id = None, 257

    def encode(self, text, add_bos=False):
        return [ord(c) % 256 for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_token_and_stop_string(tiny_model):
    llm = LLM(tiny_model, LetterTokenizer(), block_size=8, num_kv_blocks=64)
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    third = free.token_ids[2]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:3] and out.finish_reason == "stop"
    assert out.text == free.text[:2]  # the stop token is not part of the text
    stop = free.text[4:6]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, stop=["zzzzzz", stop]))[0].outputs[0]
    cut = free.text.find(stop)
    assert out.finish_reason == "stop" and out.text == free.text[:cut]
    assert out.token_ids == free.token_ids[:cut + 2]  # generation stopped at the token completing it


def test_min_tokens_and_max_tokens(llm):
    eos = llm.tokenizer.eos_token_id
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=[eos]))
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"


def test_logprobs_are_the_full_forward_log_softmax(llm, tiny_model):
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():  # one training-mode forward over prompt + output: the reference
        ref = tiny_model(torch.tensor([ids]))[0, len(out.prompt_token_ids) - 1:-1].log_softmax(-1)
    assert len(completion.logprobs) == 4
    for pos, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        top = ref[pos].topk(2)
        assert entry["token_id"] == token_id == int(top.indices[0])  # greedy: the top token
        assert abs(entry["logprob"] - float(ref[pos, token_id])) < 1e-4
        assert [i for i, _ in entry["top"]] == top.indices.tolist()
        assert [lp for _, lp in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_bad_requests_raise_value_error(llm):
    with pytest.raises(ValueError, match="context length"):
        llm.generate([1] * 600, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="KV cache"):
        tiny_cache = LLM(llm.engine.model, llm.tokenizer, block_size=8, num_kv_blocks=2)
        tiny_cache.generate("hi", SamplingParams(max_tokens=30))


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request("a long enough prompt", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chat(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3))
    assert out[0].prompt_token_ids[-len(b"Assistant:"):] == list(b"Assistant:")


def test_streamed_text_never_shows_a_stop_string(tiny_model):
    llm = LLM(tiny_model, LetterTokenizer(), block_size=8, num_kv_blocks=64)
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = free.text[6:9]
    engine = llm.engine
    engine.add_request("abc", SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    texts = []
    while engine.has_unfinished():
        texts += [out.outputs[0].text for out in engine.step()]
    final = texts[-1]
    assert final == free.text[:free.text.find(stop)]
    assert all(final.startswith(t) for t in texts)  # each streamed text only grows; stop never shown


def test_final_only_requests_output_once(llm, prompts):
    """A final_only request (generate, rollouts, non-streaming completions) returns one output, when it finishes:
    the same as the last of the cumulative ones a streamed request returns step by step."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    streamed = engine.add(engine.make_request(prompts[1], params))
    final = engine.add(engine.make_request(prompts[1], params, final_only=True))
    outputs: dict[str, list] = {streamed: [], final: []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert len(outputs[streamed]) == 5 and [o.finished for o in outputs[final]] == [True]
    last, only = outputs[streamed][-1].outputs[0], outputs[final][0].outputs[0]
    assert (only.token_ids, only.text, only.logprobs, only.finish_reason) == (
        last.token_ids, last.text, last.logprobs, last.finish_reason)


def test_reset_prefix_cache_after_weight_update(tiny_model, byte_tokenizer, prompts):
    model = copy.deepcopy(tiny_model)
    llm = LLM(model, byte_tokenizer, block_size=8, num_kv_blocks=128)
    llm.generate(prompts[-1], GREEDY)  # fills the prefix cache
    with torch.no_grad():  # an in-place "optimizer step", as co-located GRPO does
        for p in model.parameters():
            p.mul_(1.5)
    llm.reset_prefix_cache()
    out = llm.generate(prompts[-1], GREEDY)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == generate(model, prompts[-1], MAX_NEW)


def test_chat_adds_bos_once_when_the_template_writes_it(tiny_model, tmp_path):
    """HF chat templates usually start with `{{ bos_token }}`: LLM.chat and the server's chat endpoint
    (both `chat_prompt_ids`) must not add a second BOS."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from seekforge.model.tokenizer import HFTokenizer

    tk = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<s>", "</s>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    llm = LLM(tiny_model, HFTokenizer(tmp_path), block_size=8, num_kv_blocks=16)
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.prompt_token_ids == [0, 2]  # <s> hello


def test_prompt_starts_with_bos_only_where_the_tokenizer_says_so(tiny_model, tmp_path):
    """A BOS the model never saw in training hurts its text: string prompts get one only when the
    tokenizer's config says `add_bos_token` (the byte tokenizer's models train without one)."""
    import json

    from seekforge.model.tokenizer import ByteTokenizer, load_tokenizer

    one = SamplingParams(max_tokens=1, temperature=0.0)
    assert LLM(tiny_model, ByteTokenizer()).generate("hi", one)[0].prompt_token_ids == [104, 105]
    ByteTokenizer().save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert LLM(tiny_model, load_tokenizer(tmp_path)).generate("hi", one)[0].prompt_token_ids == [256, 104, 105]
