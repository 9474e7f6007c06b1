"""Prompt logprobs through the API: `echo` + `logprobs` + `max_tokens: 0` (what lm-eval's
local-completions sends to score a prompt) and vLLM's `prompt_logprobs`, checked against transformers
on the exported checkpoint; the full lm-eval comparison (local-completions through the server vs
lm-eval's `hf` backend on the same directory) is a slow test."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from seekforge.config import EngineConfig, preset
from seekforge.model.hf import save_hf
from seekforge.model.load import load_model
from seekforge.model.model import build_model
from seekforge.model.tokenizer import load_tokenizer
from seekforge.serve import LLM, SamplingParams

from .conftest import serving

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """The tiny preset exported as an HF directory (weights + byte tokenizer), as `convert` writes it."""
    path = tmp_path_factory.mktemp("export")
    save_hf(build_model(preset("tiny"), seed=3), path)
    load_tokenizer("byte").save(path)
    return path


@pytest.fixture(scope="module")
def server(export_dir):
    model, tokenizer = load_model(str(export_dir), torch.float32)
    # small blocks and budget: a prompt spans several prefill chunks and cached blocks exist
    with serving(model, tokenizer, EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=8)) as s:
        yield s


def hf_prompt_logprobs(export_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log p(token t | tokens < t) for t = 1..len-1 on the exported directory."""
    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_engine_prompt_logprobs_match_a_full_forward(tiny_model, byte_tokenizer):
    """Chunked prefill (chunks of 8) with a warm prefix cache gives the prompt logprobs of one full
    forward: prefix-cache hits are skipped for such requests."""
    llm = LLM(tiny_model, byte_tokenizer, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    ids = list(range(30, 67))
    llm.generate(ids, SamplingParams(max_tokens=1))  # fills the prefix cache with this prompt
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
    with torch.no_grad():
        logp = tiny_model(torch.tensor([ids])).float().log_softmax(-1)[0]
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([e["logprob"] for e in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    top = out.prompt_logprobs[5]["top"]
    assert [i for i, _ in top] == logp[4].topk(3).indices.tolist()  # row 4 predicts token 5
    rank = out.prompt_logprobs[5]["rank"]
    assert rank == int((logp[4] > logp[4, ids[5]]).sum()) + 1


def test_prompt_logprobs_survive_preemption(tiny_model, byte_tokenizer):
    """12 blocks of 4 for two 40-token sequences: they preempt each other and recompute; prompt
    positions already scored are not scored twice."""
    llm = LLM(tiny_model, byte_tokenizer, block_size=4, num_kv_blocks=12, max_num_batched_tokens=8)
    ids = list(range(30, 50))
    greedy = {"max_tokens": 20, "ignore_eos": True, "temperature": 0}
    out = llm.generate([list(range(60, 80)), ids], [SamplingParams(**greedy),
                                                    SamplingParams(**greedy, prompt_logprobs=1)])[1]
    assert llm.engine.scheduler.num_preemptions > 0 and len(out.prompt_logprobs) == len(ids)
    with torch.no_grad():
        logp = tiny_model(torch.tensor([ids])).float().log_softmax(-1)[0]
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e["logprob"] for e in out.prompt_logprobs[1:]]), want, atol=1e-5, rtol=0)


def test_echo_logprobs_match_transformers(server, export_dir):
    ids = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 101, 32, 101, 110, 100]
    r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == bytes(ids).decode() and choice["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts token 0
    assert len(lp["token_logprobs"]) == len(ids) and lp["text_offset"] == list(range(len(ids)))
    got = torch.tensor(lp["token_logprobs"][1:])
    torch.testing.assert_close(got, hf_prompt_logprobs(export_dir, ids), atol=1e-4, rtol=0)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])


def test_echo_with_generation_and_prompt_logprobs_extension(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="tiny", prompt="abcdefgh", max_tokens=3, echo=True, logprobs=2,
                                  temperature=0, extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    choice = r.choices[0]
    assert choice.text.startswith("abcdefgh") and len(choice.logprobs.tokens) == 8 + 3
    assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
    # vLLM's prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}} with the prompt token
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == 8
    entry = prompt_logprobs[1][str(ord("b"))]
    assert entry["decoded_token"] == "b" and entry["logprob"] == pytest.approx(choice.logprobs.token_logprobs[1])
    # streaming: the prompt and its logprobs come in each choice's first chunk
    chunks = list(client.completions.create(model="tiny", prompt="abcdefgh", max_tokens=3, echo=True, logprobs=0,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(choice.logprobs.token_logprobs)
    stream = list(client.completions.create(model="tiny", prompt="abcdefgh", max_tokens=3, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "prompt_logprobs": 0}))
    with_prompt = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    assert not any(with_prompt[1:])  # only in the first chunk, as vLLM; k=0: just the prompt token
    assert [e and list(e) for e in with_prompt[0]] == [None, *[[str(b)] for b in b"bcdefgh"]]
    assert with_prompt[0][1] == {"98": prompt_logprobs[1]["98"]}


def test_tokenize_and_detokenize_as_vllm(server):
    base = server.base_url
    r = httpx.post(base + "/tokenize", json={"model": "tiny", "prompt": "hé", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": r["max_model_len"], "tokens": [104, 195, 169],
                 "token_strs": ["h", "Ã", "©"]}  # GPT-2's symbols for bytes 195, 169: convert_ids_to_tokens
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert bytes(chat["tokens"]).decode() == "User: hi\nAssistant:" and chat["token_strs"] is None
    assert httpx.post(base + "/detokenize", json={"tokens": [104, 195, 169]}).json() == {"prompt": "hé"}
    missing = httpx.post(base + "/tokenize", json={"model": "nope", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------------ lm-eval
MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Fish live in", "choices": [" trees", " water", " fire", " sand"], "answer": 1},
    {"question": "Ice is", "choices": [" cold", " hot"], "answer": 0},
    {"question": "A cat says", "choices": [" woof", " meow", " moo"], "answer": 1},
]

TASK_YAML = """\
task: seekforge_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def run_lm_eval(model: str, model_args: str, task_dir) -> list[list[float]]:
    """Per sample, the loglikelihood of each choice, from lm-eval on the local task."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=["seekforge_mc"], log_samples=True,
                              task_manager=TaskManager(include_path=str(task_dir)), random_seed=0)
    samples = sorted(results["samples"]["seekforge_mc"], key=lambda s: s["doc_id"])
    return [[resp[0][0] for resp in s["resps"]] for s in samples]


@pytest.mark.slow
def test_lm_eval_local_completions_equals_hf_backend(server, export_dir, tmp_path):
    pytest.importorskip("lm_eval")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "seekforge_mc.yaml").write_text(TASK_YAML.format(docs=docs))
    served = run_lm_eval("local-completions", f"model=tiny,base_url={server.base_url}/v1/completions,"
                         f"tokenizer={export_dir},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
                         tmp_path)
    reference = run_lm_eval("hf", f"pretrained={export_dir},dtype=float32,device=cpu,batch_size=1", tmp_path)
    assert [len(s) for s in served] == [len(d["choices"]) for d in MC_DOCS]
    torch.testing.assert_close(torch.tensor(sum(served, [])), torch.tensor(sum(reference, [])), atol=1e-4, rtol=0)


def test_error_shapes_as_openai(server):
    base = server.base_url
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/v1/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (POST /v1/nothing)"
    r = httpx.get(base + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(base + "/v1/chat/completions",
                   json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": r.json()["error"]["message"], "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}
