"""Dense decode rows (kv_cache.DenseRows) against the per-step gather of the pool they replace."""

import copy

import pytest
import torch

from seekforge.config import preset
from seekforge.model.model import build_model
from seekforge.model.precision import onednn
from seekforge.serve.engine import LLM
from seekforge.serve.kv_cache import DenseRows, mask_width
from seekforge.serve.sequence import SamplingParams


def test_plan_builds_rows_when_a_decoding_set_continues_and_appends_after():
    rows = DenseRows(budget_bytes=10**9, bytes_per_token=10)
    assert rows.plan([4, 7], [9, 20], "cpu") is None  # a new set: gather
    built = rows.plan([4, 7], [10, 21], "cpu")  # the same set one token further: build
    assert built.rebuild and built.capacity == 256 and built.context_len == 22 and built.rows == 2
    step = rows.plan([4, 7], [11, 22], "cpu")
    assert not step.rebuild and step.write_index.tolist() == [11, 256 + 22]
    assert rows.plan([7, 4], [23, 12], "cpu") is None  # another order: other rows
    assert rows.plan([7, 4], [24, 13], "cpu").rebuild
    assert rows.plan([7, 4], [26, 14], "cpu") is None  # a skipped position (multi-step, spec decode)
    assert rows.plan([7, 4], [27, 15], "cpu").rebuild
    rows.invalidate()
    assert rows.plan([7, 4], [28, 16], "cpu") is None
    assert rows.plan([7, 4], [29, 17], "cpu").rebuild
    assert not rows.plan([7, 4], [30, 18], "cpu").rebuild
    grown = rows.plan([7, 4], [31, 19], "cpu")
    rows.capacity = 32  # as if the rows were built at a short context: the next step outgrows them
    assert rows.plan([7, 4], [32, 20], "cpu").rebuild and rows.capacity == 256 and not grown.rebuild
    pow2 = DenseRows(budget_bytes=10**9, bytes_per_token=10)
    pow2.plan([1, 2, 3], [5, 5, 5], "cpu")
    assert pow2.plan([1, 2, 3], [6, 6, 6], "cpu").rows == 4  # room to grow: a power of two
    fit = DenseRows(budget_bytes=3 * 256 * 10, bytes_per_token=10)
    fit.plan([1, 2, 3], [5, 5, 5], "cpu")
    assert fit.plan([1, 2, 3], [6, 6, 6], "cpu").rows == 3  # ... within the budget
    tight = DenseRows(budget_bytes=100, bytes_per_token=10)
    assert tight.plan([1], [9], "cpu") is None and tight.plan([1], [10], "cpu") is None  # over budget
    at_once = DenseRows(budget_bytes=10**9, bytes_per_token=10, at_once=True)  # compiled steps: build a new set
    first = at_once.plan([4, 7], [9, 20], "cpu")
    assert first.rebuild and first.write_index.tolist() == [9, 256 + 20]
    assert not at_once.plan([4, 7], [10, 21], "cpu").rebuild and at_once.plan([7, 4], [22, 11], "cpu").rebuild


def dense_and_gathered(model, tokenizer, batches, params, **llm_kwargs):
    """Each batch of prompts generated in turn on one engine with the dense rows and on one that always
    gathers (no budget for rows) → ({True: dense outputs, False: gathered outputs}, the dense engine's plans)."""
    results, plans = {}, []
    for dense in (True, False):
        llm = LLM(model, tokenizer, **llm_kwargs)
        rows = llm.engine.runner.dense_rows
        if dense:
            rows.plan = lambda *a, plan=rows.plan: plans.append(plan(*a)) or plans[-1]
        else:
            rows.budget_bytes = 0
        results[dense] = [out for batch in batches for out in llm.generate(batch, params)]
    return results, plans


def assert_same_outputs(outputs, others, atol):
    """The same greedy tokens, and the top logprobs within atol."""
    for a, b in zip(outputs, others, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            torch.testing.assert_close(torch.tensor([lp for _, lp in x["top"]]),
                                       torch.tensor([lp for _, lp in y["top"]]), rtol=0, atol=atol)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_dense_decode_equals_gather(tiny_model, byte_tokenizer, kv_cache_dtype):
    """Same greedy tokens and logprobs (to 1e-5) with the dense rows as with the gather, across steps where
    the decoding set changes (requests of different lengths finish, new ones join mid-way)."""
    prompts = [list(range(3 + 5 * i, 20 + 7 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True, logprobs=2) for i in range(6)]
    # 600 blocks: room for the dense rows in fp32 within the budget of an int8 pool (4x smaller)
    results, plans = dense_and_gathered(tiny_model, byte_tokenizer, [prompts], params, block_size=8,
                                        num_kv_blocks=600, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    kept = sum(p is not None and not p.rebuild for p in plans)
    built = sum(p is not None and p.rebuild for p in plans)
    assert kept > 20 and built > 3 and None in plans  # every kind of step ran
    assert_same_outputs(results[True], results[False], atol=1e-5)


def test_rows_of_one_length_skip_the_mask(tiny_model, byte_tokenizer):
    """Decode rows whose contexts are all as long (prompts of one length, batch 1) are planned `uniform` and
    attend without a mask: the same tokens and logprobs (to 1e-5) as the gather, which masks."""
    rows = DenseRows(budget_bytes=1 << 20, bytes_per_token=10)
    rows.plan([1, 2], [5, 5], "cpu")
    assert rows.plan([1, 2], [6, 6], "cpu").uniform
    rows.plan([1, 2], [5, 8], "cpu")
    assert not rows.plan([1, 2], [6, 9], "cpu").uniform
    prompts = [list(range(3 + 5 * i, 20 + 5 * i)) for i in range(4)]  # 17 tokens each
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results, plans = dense_and_gathered(tiny_model, byte_tokenizer, [prompts[:1], prompts], params, block_size=8,
                                        num_kv_blocks=200, max_num_seqs=4)
    assert sum(p is not None and p.uniform for p in plans) > 10
    assert_same_outputs(results[True], results[False], atol=1e-5)


def test_bf16_cpu_decode_kernels_match(tiny_model, byte_tokenizer):
    """A bf16 model on a CPU decodes one-token steps with its linear layers on torch's own kernels
    (precision.onednn): the same greedy tokens, and logprobs within bf16 rounding, as oneDNN everywhere;
    at batch 1 and batch 4."""
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    prompts = [list(range(3 + 5 * i, 20 + 7 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True, logprobs=2)
    results = {}
    for new in (True, False):
        llm = LLM(model, byte_tokenizer, block_size=8, num_kv_blocks=200, max_num_seqs=4)
        assert llm.engine.runner.one_row_native
        llm.engine.runner.one_row_native = new
        results[new] = llm.generate(prompts[:1], params) + llm.generate(prompts, params)
    assert_same_outputs(results[True], results[False], atol=2e-2)
    # build_model and HF loading keep the routers in fp32: still a bf16 model; fp32 ones are not
    assert LLM(build_model(preset("tiny"), dtype=torch.bfloat16)).engine.runner.one_row_native
    assert not LLM(build_model(preset("tiny"))).engine.runner.one_row_native


def test_onednn_switch_restores_and_masks_widen():
    before = torch._C._get_mkldnn_enabled()
    with onednn(False):
        assert not torch._C._get_mkldnn_enabled()
        with onednn(True):
            assert torch._C._get_mkldnn_enabled()
        assert not torch._C._get_mkldnn_enabled()
    assert torch._C._get_mkldnn_enabled() == before
    mask = torch.tensor([[True, True, False]])
    assert mask_width(mask, 2).tolist() == [[True, True]]
    assert mask_width(mask, 5).tolist() == [[True, True, False, False, False]]
