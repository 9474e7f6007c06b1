"""Compiled batch-1 decode steps (serve/compiled.py, EngineConfig.compile): the engine with them produces
the eager engine's greedy tokens and logprobs — one sequence, several of one context length, several of
different lengths (masked) — each program serving every context length (the dense rows growing past their
capacity included) and batch size; unsupported configs decode eagerly, and so does an engine whose compile
fails."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from seekforge.config import EngineConfig, preset
from seekforge.model.model import build_model
from seekforge.serve import compiled as compiled_module
from seekforge.serve.compiled import CompiledDecode
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def logprobs(output) -> torch.Tensor:
    return torch.tensor([t["logprob"] for t in output.logprobs])


@pytest.fixture(scope="module")
def compiled_llm(tiny_model, byte_tokenizer):
    return LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=256, compile=True)


@pytest.fixture()
def compiled_calls(monkeypatch):
    """How many steps ran compiled."""
    calls = []
    original = CompiledDecode.__call__
    monkeypatch.setattr(CompiledDecode, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    return calls


def test_compiled_steps_equal_eager(compiled_llm, tiny_model, byte_tokenizer, compiled_calls):
    assert compiled_llm.engine.runner.compiled is not None
    eager = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=256)
    g = torch.Generator().manual_seed(1)
    # 10 → 300 tokens of context: the dense rows (capacity ~256 at first) are rebuilt wider on the way
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (10, 75)]
    graphs = counters["stats"]["unique_graphs"]
    for prompt, new in zip(prompts, (290, 40), strict=True):
        want = eager.generate([prompt], greedy(new))[0].outputs[0]
        got = compiled_llm.generate([prompt], greedy(new))[0].outputs[0]
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(logprobs(got), logprobs(want), rtol=0, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up's program served every length
    assert len(compiled_calls) == 289 + 39  # every decode step, the dense rows' builds included


@pytest.mark.parametrize("lengths", [(30, 30, 30), (7, 30, 12)], ids=["one-length", "masked"])
def test_batched_compiled_steps_equal_eager(compiled_llm, tiny_model, byte_tokenizer, compiled_calls, lengths):
    eager = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=256)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    params = [greedy(n) for n in (5, 9, 30)]  # 3, then 2 rows, then one: every program
    want = eager.generate(prompts, params)
    got = compiled_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(logprobs(a.outputs[0]), logprobs(b.outputs[0]), rtol=0, atol=1e-4)
    # 29 decode steps, all compiled: each new set of rows (3, 2, then 1) has its dense rows built first
    assert len(compiled_calls) == 29


def test_multi_step_scheduling_runs_the_compiled_steps(compiled_llm, tiny_model, byte_tokenizer, compiled_calls,
                                                       monkeypatch):
    """num_scheduler_steps N with compile: each of the N steps is the compiled program (the eager model over the
    pool would be slower than N single steps), so tokens and logprobs are the compiled single steps'."""
    from seekforge.model.model import Transformer

    multi = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=256, compile=True, num_scheduler_steps=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 21)]
    params = [greedy(13), greedy(30)]
    want = compiled_llm.generate(prompts, params)
    single = len(compiled_calls)
    eager_rows = []
    hidden = Transformer.hidden
    monkeypatch.setattr(Transformer, "hidden", lambda self, ids, **kw: eager_rows.append(ids.shape[1]) or hidden(
        self, ids, **kw))
    got = multi.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(logprobs(a.outputs[0]), logprobs(b.outputs[0]), rtol=0, atol=1e-6)
    assert eager_rows == [9 + 21]  # the eager model prefilled; every decode step ran compiled
    assert len(compiled_calls) - single >= single  # and the N steps past the first sequence's last token too


def test_programs_are_entered_directly_and_see_weights_changed_in_place(compiled_llm, tiny_model, byte_tokenizer,
                                                                        compiled_calls):
    """Each program runs its compiled graph without dynamo's entry (DirectEntry), and reads the model's weights
    when it runs: a weight's values changed in place and a parameter's `.data` swapped (as GRPO's updates and
    MasterWeights do after the programs were traced) reach the compiled steps as they reach the eager ones."""
    assert set(compiled_llm.engine.runner.compiled.entries) == {"one", "rows", "masked"}
    eager = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64)
    prompts = [list(range(5, 30)), list(range(40, 52))]
    params = [greedy(10), greedy(14)]
    before = [o.outputs[0].token_ids for o in compiled_llm.generate(prompts, params)]
    head, expert = tiny_model.lm_head.weight, tiny_model.moe_layers()[0].experts.gate_up_proj
    head_data = head.data
    try:
        with torch.no_grad():
            head.data = head_data.flip(0).contiguous()
            expert.mul_(-1)
        want = [o.outputs[0] for o in eager.generate(prompts, params)]
        got = [o.outputs[0] for o in compiled_llm.generate(prompts, params)]
    finally:
        with torch.no_grad():
            head.data = head_data
            expert.mul_(-1)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] != before
    for a, b in zip(got, want, strict=True):  # logprobs of -5 to -10 here: fp32's reordered sums, relatively
        torch.testing.assert_close(logprobs(a), logprobs(b), rtol=5e-4, atol=1e-4)
    # each generate: 13 decode steps, all compiled
    assert len(compiled_calls) == 2 * 13


def test_inductors_function_is_called_directly_once_checked(compiled_llm, monkeypatch):
    """DirectEntry calls inductor's C++ function itself once that call returned what dynamo's entry did and wrote
    the rows the step writes (pool slots, dense rows); a call that gets either wrong goes through AOT's wrapper."""
    compiled = compiled_llm.engine.runner.compiled
    steps = []
    run = CompiledDecode._run
    monkeypatch.setattr(CompiledDecode, "_run", lambda self, *a: steps.append(a) or run(self, *a))
    compiled_llm.generate([list(range(5, 20))], greedy(3))
    program, ids, positions, slots, write_index, context_len, mask, dense = steps[-1]
    entry = compiled.entries[program]
    assert entry.entry is not None
    pools = [(c.c_kv, c.k_pe) for c in compiled.caches]
    args = (compiled.model, ids, positions, slots, write_index, context_len, mask, pools, dense)
    written = compiled._written(slots, write_index, dense)
    with torch.inference_mode():
        expected = entry(args)
        real = compiled_module.inductor_entry(entry.compiled)

        def forgetful(handles):  # the outputs right, the step's rows left unwritten
            out = real(handles)
            for rows, index in written:
                rows[index] = 0
            return out

        for wrong in (lambda handles: real(handles)[::-1], forgetful):
            monkeypatch.setattr(compiled_module, "inductor_entry", lambda compiled, wrong=wrong: wrong)
            assert entry.matches(args, expected, written) and entry.entry is None
        monkeypatch.setattr(compiled_module, "inductor_entry", lambda compiled: real)
        assert entry.matches(args, expected, written) and entry.entry is real
        assert all(torch.equal(a, b) for a, b in zip(entry(args), expected, strict=True))


def test_each_program_is_compiled_once(tiny_model, byte_tokenizer, monkeypatch):
    """Dynamo restarts a trace to specialize the floats it could not make tensors (one passed to an op taking a
    Python float), and the restarted trace reaches the backend again: twice the start-up time."""
    compiles = []
    backend = CompiledDecode._backend

    def counted(self, program):
        compile = backend(self, program)
        return lambda gm, example_inputs, **kwargs: compiles.append(program) or compile(gm, example_inputs, **kwargs)

    monkeypatch.setattr(CompiledDecode, "_backend", counted)
    llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=256, compile=True)  # compiled_llm's programs
    assert llm.engine.runner.compiled is not None
    assert sorted(compiles) == sorted(compiled_module.PROGRAMS)


def test_unsupported_configs_decode_eagerly(tiny_model):
    assert "int8" in CompiledDecode.supports(tiny_model, EngineConfig(kv_cache_dtype="int8"))
    assert "LoRA" in CompiledDecode.supports(tiny_model, EngineConfig(enable_lora=True))
    assert CompiledDecode.supports(tiny_model, EngineConfig()) is None


def test_a_failed_compile_serves_eagerly(tiny_model, byte_tokenizer, monkeypatch, caplog):
    def no_compiler(fn, **kwargs):
        def fail(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
        return fail

    monkeypatch.setattr(compiled_module.torch, "compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger="seekforge.serve"):
        llm = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64, compile=True)
    assert llm.engine.runner.compiled is None
    assert "decoding eagerly: InvalidCxxCompiler: No working C++ compiler found" in caplog.text
    eager = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64)
    prompt = list(range(20))
    assert llm.generate([prompt], greedy(8))[0].outputs[0].token_ids == \
        eager.generate([prompt], greedy(8))[0].outputs[0].token_ids


def test_bf16_programs_follow_eager(compiled_llm, tiny_model, byte_tokenizer):
    """bf16: the experts' batch at oneDNN's bucketed sizes (ExpertSlots.traced's other branch). The fused
    kernels keep fp32 intermediates where the eager ops round to bf16, so greedy tokens may part at a near-tie:
    logprobs are compared up to the first difference, loosely. Built beside the fp32 engine, each engine runs
    its own programs (with no guards, a shared compile cache would hand one the other's)."""
    model = build_model(preset("tiny"), seed=0).eval()
    model.cast(torch.bfloat16)
    compiled = LLM(model, byte_tokenizer, block_size=8, num_kv_blocks=64, compile=True)
    assert compiled.engine.runner.compiled is not None
    eager = LLM(model, byte_tokenizer, block_size=8, num_kv_blocks=64)
    prompts = [list(range(3, 40)), list(range(50, 70))]
    params = [greedy(12), greedy(16)]  # masked rows, then one sequence
    for got, want in zip(compiled.generate(prompts, params), eager.generate(prompts, params), strict=True):
        got, want = got.outputs[0], want.outputs[0]
        pairs = enumerate(zip(got.token_ids, want.token_ids, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(got.token_ids))
        assert same >= 1  # the prefill is eager in both
        torch.testing.assert_close(logprobs(got)[:same], logprobs(want)[:same], rtol=0, atol=0.05)
    fp32_eager = LLM(tiny_model, byte_tokenizer, block_size=8, num_kv_blocks=64)
    prompt = list(range(100, 130))
    assert compiled_llm.generate([prompt], greedy(10))[0].outputs[0].token_ids == \
        fp32_eager.generate([prompt], greedy(10))[0].outputs[0].token_ids
