"""The engine's int8 latent cache: decode equals the fp-cache reference within a stated tolerance."""

import pytest
import torch

from seekforge.config import EngineConfig
from seekforge.model.tokenizer import load_tokenizer
from seekforge.serve.engine import LLM
from seekforge.serve.kv_cache import bytes_per_block
from seekforge.serve.sequence import SamplingParams

# Per-token absmax int8 puts each cached latent within 1/254 of its row's max; through attention that
# moves the tiny preset's log-probabilities by ~1e-3. The bound leaves ~10x margin.
LOGPROB_TOL = 2e-2


def test_int8_cache_decode_matches_the_full_forward(tiny):
    llm = LLM(tiny, load_tokenizer("byte"), block_size=8, num_kv_blocks=64, kv_cache_dtype="int8")
    caches = llm.engine.runner.caches
    out = llm.generate("the cat sat on", SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True))[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():  # fp reference: one full forward, no cache at all
        ref = tiny(torch.tensor([ids]))[0, len(out.prompt_token_ids) - 1:-1].log_softmax(-1)
    worst = max(abs(entry["logprob"] - float(ref[pos, token_id]))
                for pos, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)))
    print(f"int8 cache: worst |Δ logprob| = {worst:.2e}")
    assert worst < LOGPROB_TOL
    agree = sum(int(ref[pos].argmax()) == t for pos, t in enumerate(completion.token_ids))
    assert agree >= len(completion.token_ids) - 1  # a near-tie may flip at most once
    assert caches[0].c_kv.dtype == torch.int8 and caches[0].c_kv_scale is not None


def test_int8_cache_bytes(tiny):
    cfg = tiny.cfg
    per_token_bf16 = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    per_token_int8 = cfg.kv_lora_rank + cfg.qk_rope_head_dim + 8
    assert bytes_per_block(cfg, 16, torch.bfloat16) == per_token_bf16 * 16 * cfg.num_hidden_layers
    assert bytes_per_block(cfg, 16, torch.int8) == per_token_int8 * 16 * cfg.num_hidden_layers


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
