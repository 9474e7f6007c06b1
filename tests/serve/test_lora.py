"""Multi-LoRA serving against transformers + peft: an adapter trained with peft on transformers'
DeepseekV3 gives the same logits in the engine (naive prefill and absorbed decode, kv_b_proj included);
a batch mixing two adapters and the base equals per-adapter runs; the adapter keys the prefix cache;
load / unload through the server while requests run."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from seekforge.config import EngineConfig
from seekforge.model.hf import load_hf
from seekforge.serve.engine import LLM, LLMEngine
from seekforge.serve.runner import Chunk
from seekforge.serve.sequence import SamplingParams, Sequence
from tests.model.test_hf import CASES, SIZES, hf_model

peft = pytest.importorskip("peft")

LOGITS_ATOL = 1e-4
# MLA's projections; peft maps MLP names onto transformers' fused routed experts (parameters, not linears),
# which the engine does not serve (load_adapter rejects them)
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def train_adapter(base, out_dir, seed: int, targets=TARGETS, rslora=False):
    """A few Adam steps of a peft LoRA on transformers' model (next-token loss on random tokens), saved."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, use_rslora=rslora)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(seed))
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out_dir)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """transformers' model saved and loaded into seekforge, and two peft adapters trained on it."""
    root = tmp_path_factory.mktemp("lora")
    reference = hf_model(**CASES["q_lora-yarn-4groups-interleave"])
    reference.save_pretrained(root / "base")
    with pytest.warns(UserWarning, match="num_nextn_predict_layers"):
        model = load_hf(root / "base").eval()
    adapters = {}
    for name, seed, targets, rslora in (("a", 1, TARGETS, False), ("b", 2, ["kv_b_proj", "o_proj", "q_b_proj"], True)):
        base = hf_model(**CASES["q_lora-yarn-4groups-interleave"])
        base.load_state_dict(reference.state_dict())
        adapters[name] = (str(root / name), train_adapter(base, root / name, seed, targets, rslora))
    return model, reference, adapters


def engine_logits(engine: LLMEngine, tokens: list[int], lora_name: str | None, prefill: int) -> torch.Tensor:
    """The runner's logits (len(tokens), V): the first `prefill` tokens as one prefill chunk (naive MLA),
    then one decode row per token (absorbed MLA against the paged cache)."""
    lora = engine.lora_adapters.get(lora_name)
    seq = Sequence("r", 0, tokens, SamplingParams(), 1, None, lora=lora)
    assert engine.block_manager.allocate(seq, len(tokens))
    runner, out = engine.runner, []
    for start, end, decode in [(0, prefill, False)] + [(i, i + 1, True) for i in range(prefill, len(tokens))]:
        hidden, _ = runner.forward([Chunk(seq, start, tokens[start:end], decode)])
        out.append(runner.logits(hidden))
        seq.num_computed_tokens = end
    engine.block_manager.free(seq)
    return torch.cat(out)


def test_logits_match_transformers_peft(setup, byte_tokenizer):
    model, reference, adapters = setup
    engine = LLMEngine(model, byte_tokenizer, EngineConfig(num_kv_blocks=32, block_size=8, enable_lora=True))
    for name, (path, _) in adapters.items():
        engine.load_lora(name, path)
    tokens = torch.randint(0, SIZES["vocab_size"], (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        base = reference(torch.tensor([tokens])).logits[0]
        for name, (_, peft_model) in adapters.items():
            expected = peft_model(torch.tensor([tokens])).logits[0]
            assert (expected - base).abs().max() > 0.05  # the adapter changes the logits: the test means something
            got = engine_logits(engine, tokens, name, prefill=30)
            assert (got - expected).abs().max() < LOGITS_ATOL, name
        assert (engine_logits(engine, tokens, None, prefill=30) - base).abs().max() < LOGITS_ATOL


def test_mixed_batch_equals_per_adapter_runs(setup):
    model, _, adapters = setup
    llm = LLM(model, num_kv_blocks=96, block_size=8, enable_lora=True, max_num_batched_tokens=48)
    for name, (path, _) in adapters.items():
        llm.engine.load_lora(name, path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, SIZES["vocab_size"], (n,), generator=g).tolist() for n in (5, 19, 33, 12, 27, 8)]
    names = ["a", None, "b", "a", "b", None]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_name=names)]
    alone = [llm.generate([p], params, lora_name=n)[0].outputs[0].token_ids
             for p, n in zip(prompts, names, strict=True)]
    assert mixed == alone
    steps = LLM(model, num_kv_blocks=96, block_size=8, enable_lora=True, num_scheduler_steps=4)
    for name, (path, _) in adapters.items():
        steps.engine.load_lora(name, path)
    assert [o.outputs[0].token_ids for o in steps.generate(prompts, params, lora_name=names)] == mixed
    assert llm.generate([prompts[0]], params)[0].outputs[0].token_ids != mixed[0]  # "a" changes the output


def test_adapter_keys_the_prefix_cache(setup):
    model, _, adapters = setup
    llm = LLM(model, num_kv_blocks=64, block_size=8, enable_lora=True)
    llm.engine.load_lora("a", adapters["a"][0])
    prompt = list(range(40))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params, lora_name="a")
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0  # the base never reuses a's latents
    assert llm.generate([prompt], params, lora_name="a")[0].num_cached_tokens == 32


def test_bad_adapter_and_lora_off(setup, tmp_path, byte_tokenizer):
    model, _, adapters = setup
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLMEngine(model, byte_tokenizer, EngineConfig(num_kv_blocks=8)).load_lora("a", adapters["a"][0])
    engine = LLMEngine(model, byte_tokenizer, EngineConfig(num_kv_blocks=8, enable_lora=True))
    with pytest.raises(ValueError, match="adapter_config.json"):
        engine.load_lora("x", str(tmp_path))
    with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
        engine.make_request([1, 2], lora_name="x")
    import copy

    from seekforge.quant.calibrate import quantize_model
    from seekforge.quant.recipe import Recipe

    quantized = copy.deepcopy(model)
    quantize_model(quantized, Recipe(scheme="w8a8-dynamic"), progress=False)
    engine = LLMEngine(quantized, byte_tokenizer, EngineConfig(num_kv_blocks=8, enable_lora=True))
    with pytest.raises(ValueError, match="is quantized in this checkpoint"):
        engine.load_lora("a", adapters["a"][0])


def test_load_unload_through_the_server_under_load(setup, byte_tokenizer):
    from tests.serve.conftest import serving

    model, _, adapters = setup
    path = adapters["a"][0]
    expected = LLM(model, num_kv_blocks=64, block_size=8, enable_lora=True)
    expected.engine.load_lora("a", path)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = expected.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             lora_name="a")[0].outputs[0].text
    config = EngineConfig(num_kv_blocks=64, block_size=8, enable_lora=True)
    with serving(model, byte_tokenizer, config) as server:
        url = server.base_url
        errors = []

        def background():  # base-model requests in flight the whole time
            for _ in range(6):
                r = httpx.post(f"{url}/v1/completions", json={**body, "model": "tiny", "max_tokens": 24}, timeout=60)
                if r.status_code != 200:
                    errors.append(r.text)

        thread = threading.Thread(target=background)
        thread.start()
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path}, timeout=60)
        assert r.status_code == 200, r.text
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert {"id": "a", "parent": "tiny", "root": path}.items() <= next(m for m in models if m["id"] == "a").items()
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": "a"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        assert r.json()["model"] == "a"  # as vLLM reports an adapter request
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": "a"}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
        assert r.status_code == 404
        thread.join()
        assert not errors


def test_serve_flags():
    import argparse

    from seekforge.serve.cli import add_arguments, engine_config_from_args, parse_lora_modules

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-tokens", "2", "--lora-modules", "a=/x", "b=/y/z"])
    config = engine_config_from_args(args)
    assert config.speculative_tokens == 2 and config.enable_lora and config.num_scheduler_steps == 1
    assert parse_lora_modules(args.lora_modules) == [("a", "/x"), ("b", "/y/z")]
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_modules(["nopath"])
    assert engine_config_from_args(parser.parse_args(["--num-scheduler-steps", "8"])).num_scheduler_steps == 8
