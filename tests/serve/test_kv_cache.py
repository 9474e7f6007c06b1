import gc
import os

import pytest
import torch

from seekforge.config import preset
from seekforge.model.model import build_model
from seekforge.model.tokenizer import load_tokenizer
from seekforge.serve import LLM, SamplingParams
from seekforge.serve import runner as runner_module
from seekforge.serve.kv_cache import GatherScratch, PagedLatentCache, fresh_runs, zeros_on_demand


def test_gather_into_shared_scratch_equals_indexing():
    """Reads through the reused scratch (the fast path) equal plain indexing of the pool (the reference),
    for a larger read after a smaller one and back, with both pools of two layers sharing one scratch."""
    cfg = preset("tiny")
    scratch = GatherScratch()
    caches = [PagedLatentCache(cfg, 12, 4, torch.float32, "cpu", scratch=scratch) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for cache in caches:
        cache.c_kv.copy_(torch.randn(cache.c_kv.shape, generator=gen))
        cache.k_pe.copy_(torch.randn(cache.k_pe.shape, generator=gen))
    for blocks in ([3, 1], [0, 7, 7, 2, 11], [5]):
        blocks = torch.tensor(blocks)
        for cache in caches:
            c_kv, k_pe = cache._read("c_kv", blocks), cache._read("k_pe", blocks)
            torch.testing.assert_close(c_kv, cache.c_kv[blocks].flatten(1), rtol=0, atol=0)
            torch.testing.assert_close(k_pe, cache.k_pe[blocks].flatten(1), rtol=0, atol=0)
    big = scratch.buffers["c_kv"]
    assert big.numel() == 5 * 4 * cfg.kv_lora_rank  # grown to the largest read, then reused
    assert caches[0]._read("c_kv", torch.tensor([1])).data_ptr() == big.data_ptr()
    scratch.clear()
    assert not scratch.buffers


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_pool_pages_arrive_on_first_touch():
    """The CPU pool is zeros that hold memory only where written: 256 MiB allocated, one block written."""
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        pool = zeros_on_demand((2, 3, 4), dtype, "cpu")
        assert pool.dtype == dtype and pool.shape == (2, 3, 4) and pool.is_contiguous()
        assert torch.equal(pool, torch.zeros(2, 3, 4, dtype=dtype))
    assert zeros_on_demand((0, 16, 8), torch.float32, "cpu").shape == (0, 16, 8)
    before = _rss_bytes()
    pool = zeros_on_demand((4096, 16, 1024), torch.float32, "cpu")  # 256 MiB
    gc.collect()  # the tensor alone keeps its memory map alive
    pool[7].fill_(1.0)
    assert _rss_bytes() - before < 32 * 2**20
    assert pool.sum() == 16 * 1024 and pool[8].abs().sum() == 0


def test_fresh_runs_group_adjacent_first_chunks_of_similar_length():
    """Runs of two or more adjacent prompt-first chunks; a chunk after a cached prefix (start > 0) ends a
    run and goes alone; a prompt far longer than the run's would pad it over 2x, so it starts a new one."""
    runs = fresh_runs([5, 7, 9, 4, 6, 6, 300, 280], [0, 0, 16, 0, 0, 0, 0, 0], num_heads=4, device="cpu")
    assert {i: count for i, (count, _) in runs.items()} == {0: 2, 3: 3, 6: 2}
    layout = runs[3][1]
    assert (layout.num_documents, layout.max_len) == (3, 6)
    assert fresh_runs([8], [0], 4, "cpu") == {} and fresh_runs([8, 8], [3, 0], 4, "cpu") == {}


def test_a_step_of_several_prompts_scores_them_as_full_forwards(monkeypatch):
    """Prompts of different lengths prefilled in one step (one run of documents, the fused attention), and a
    longer one whose second chunk attends after its first (its own chunk, masked): every prompt logprob
    equals a full forward of that prompt alone."""
    model = build_model(preset("tiny"), seed=1).eval()
    seen = []

    def spy(*args):
        seen.append(fresh_runs(*args))
        return seen[-1]

    monkeypatch.setattr(runner_module, "fresh_runs", spy)
    llm = LLM(model, load_tokenizer("byte"), block_size=4, num_kv_blocks=128, max_num_batched_tokens=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 12, 14, 11, 40)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert any(count >= 4 for runs in seen for count, _ in runs.values())
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logp = model(torch.tensor([ids])).float().log_softmax(-1)[0]
        want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        got = torch.tensor([e["logprob"] for e in out.prompt_logprobs[1:]])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
