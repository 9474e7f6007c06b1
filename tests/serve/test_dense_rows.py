"""Dense decode rows (kv_cache.DenseRows) against the per-step gather of the pool they replace."""

import pytest
import torch

from seekforge.serve.engine import LLM
from seekforge.serve.kv_cache import DenseRows
from seekforge.serve.sequence import SamplingParams


def test_plan_keeps_rows_only_for_the_same_sequences_one_token_further():
    rows = DenseRows(budget_bytes=10**9, bytes_per_token=10)
    first = rows.plan([4, 7], [9, 20], "cpu")
    assert first.rebuild and first.capacity == 256 and first.context_len == 21 and first.rows == 2
    step = rows.plan([4, 7], [10, 21], "cpu")
    assert not step.rebuild and step.write_index.tolist() == [10, 256 + 21]
    assert rows.plan([7, 4], [22, 11], "cpu").rebuild  # another order: other rows
    assert rows.plan([7, 4], [24, 12], "cpu").rebuild  # a skipped position (multi-step, spec decode)
    rows.invalidate()
    assert rows.plan([7, 4], [25, 13], "cpu").rebuild
    assert rows.plan([7, 4], [26, 230], "cpu").capacity == 384  # grows with headroom: a rebuild
    assert rows.plan([1, 2, 3], [5, 5, 5], "cpu").rows == 4  # room to grow: a power of two
    assert DenseRows(budget_bytes=3 * 256 * 10, bytes_per_token=10).plan([1, 2, 3], [5, 5, 5], "cpu").rows == 3
    assert DenseRows(budget_bytes=100, bytes_per_token=10).plan([1], [9], "cpu") is None  # over budget


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_dense_decode_equals_gather(tiny_model, byte_tokenizer, kv_cache_dtype):
    """Same greedy tokens and logprobs (to 1e-5) with the dense rows as with the gather, across steps where
    the decoding set changes (requests of different lengths finish, new ones join mid-way)."""
    prompts = [list(range(3 + 5 * i, 20 + 7 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True, logprobs=2) for i in range(6)]
    results, plans = {}, []
    for dense in (True, False):
        # 600 blocks: room for the dense rows in fp32 within the budget of an int8 pool (4x smaller)
        llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=600, max_num_seqs=4,
                  kv_cache_dtype=kv_cache_dtype)
        rows = llm.engine.runner.dense_rows
        if dense:
            rows.plan = lambda *a, plan=rows.plan: plans.append(plan(*a)) or plans[-1]
        else:
            rows.budget_bytes = 0
        results[dense] = llm.generate(prompts, params)
    kept = sum(not p.rebuild for p in plans)
    assert kept > 20 and sum(p.rebuild for p in plans) > 3  # both kinds of step ran
    for a, b in zip(results[True], results[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            torch.testing.assert_close(torch.tensor([lp for _, lp in x["top"]]),
                                       torch.tensor([lp for _, lp in y["top"]]), rtol=0, atol=1e-5)
