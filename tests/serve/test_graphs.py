"""CUDA-graph decode steps (serve/graphs.py), on the CPU inside forced_gpu_path: the stand-in graph records the
captured step and replays it eagerly on the same static buffers, so these tests check the plumbing a CUDA graph
sees — inputs copied into static buffers, padding to the capture sizes, stale rows of a larger earlier batch,
pools bound at capture — against the eager engine: the same greedy tokens and the same cached latents, padding
rows writing the scratch block only, and a step free of host syncs but the one read of the sampled ids."""

from __future__ import annotations

import types

import pytest
import torch

from seekforge.config import EngineConfig
from seekforge.model.gpu import forced_gpu_path
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.serve.engine import LLM
from seekforge.serve.graphs import GraphedDecode, capture_sizes
from seekforge.serve.runner import Chunk
from seekforge.serve.sequence import SamplingParams

BLOCKS, BLOCK_SIZE = 64, 8
# step → requests arriving then (prompt length, max_tokens): the decoding batch grows 2 → 7, shrinks as they finish
# at different steps (7, 6, 5, … rows: padded to 8, then 4, 2, 1), and grows again with a late arrival
ARRIVALS = {0: [(5, 14), (19, 6)], 3: [(9, 12), (4, 3), (26, 9), (12, 16), (7, 5)], 16: [(11, 6)]}
SHORT = {0: [(5, 6), (9, 4)], 2: [(4, 5)]}  # for the tests of one feature (each step runs the kernels, interpreted)
# Ops of one graphed decode step of the tiny model (3 layers: 1 dense, 2 MoE) at 3 rows, padded to 4: the input
# copies and the replayed step, as measured (366 with the torch references of mla_decode and fused_moe) + 20%
MAX_STEP_OPS = 440


@pytest.fixture()
def graphed_rows(monkeypatch):
    """The batch size of every step that replayed a graph."""
    rows = []
    original = GraphedDecode.__call__
    monkeypatch.setattr(GraphedDecode, "__call__", lambda self, chunks: rows.append(len(chunks)) or original(self,
                                                                                                            chunks))
    return rows


def engine_args(**kwargs) -> dict:
    return dict(block_size=BLOCK_SIZE, num_kv_blocks=BLOCKS, max_num_seqs=8, **kwargs)


def run(engine, arrivals: dict, logprobs: bool = False) -> list[list[int]] | list[tuple[list[int], torch.Tensor]]:
    """Step `engine`, adding the requests of `arrivals` at their steps → each request's tokens (with `logprobs`, and
    the chosen tokens' logprobs), in arrival order."""
    g = torch.Generator().manual_seed(3)
    ids, done, step = [], {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for n, new in arrivals.get(step, []):
            prompt = torch.randint(0, 256, (n,), generator=g).tolist()
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0 if logprobs else None)
            ids.append(engine.add_request(prompt, params))
        done.update({out.request_id: out.outputs[0] for out in engine.step() if out.finished})
        step += 1
    if logprobs:
        return [(done[i].token_ids, torch.tensor([t["logprob"] for t in done[i].logprobs])) for i in ids]
    return [done[i].token_ids for i in ids]


@pytest.fixture(scope="module")
def eager_run(tiny_model, byte_tokenizer):
    """The eager engine's tokens and pools over ARRIVALS."""
    engine = LLM(tiny_model, byte_tokenizer, **engine_args()).engine
    return run(engine, ARRIVALS), [(c.c_kv.clone(), c.k_pe.clone()) for c in engine.runner.caches]


@pytest.fixture(scope="module")
def eager_short(tiny_model, byte_tokenizer):
    """The eager engine's tokens and their logprobs over SHORT."""
    return run(LLM(tiny_model, byte_tokenizer, **engine_args()).engine, SHORT, logprobs=True)


@pytest.mark.parametrize("max_batch", [8, 4], ids=["all-graphed", "larger-batches-eager"])
def test_graphed_engine_equals_eager(tiny_model, byte_tokenizer, eager_run, graphed_rows, max_batch):
    """(a) the same greedy tokens as the eager engine while the batch grows and shrinks (padding to every capture
    size, a smaller batch after a larger one, batches over the largest size eager); (c) the same latents in every
    real block of the pools: the padding rows wrote the scratch block, past them, only."""
    want, eager_pools = eager_run
    with forced_gpu_path():
        engine = LLM(tiny_model, byte_tokenizer, **engine_args(max_cuda_graph_batch=max_batch)).engine
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.sizes == capture_sizes(max_batch)
        assert engine.runner.caches[0].c_kv.shape[0] == BLOCKS + 1 and graphs.scratch_block == BLOCKS
        got = run(engine, ARRIVALS)
    assert got == want
    assert max(graphed_rows) == min(max_batch, 7) and min(graphed_rows) == 1
    assert any(b not in graphs.sizes for b in graphed_rows)  # padded steps
    assert any(later < earlier for earlier, later in zip(graphed_rows, graphed_rows[1:], strict=False))
    for cache, (c_kv, k_pe) in zip(engine.runner.caches, eager_pools, strict=True):
        torch.testing.assert_close(cache.c_kv[:BLOCKS], c_kv, rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.k_pe[:BLOCKS], k_pe, rtol=0, atol=1e-5)
        assert cache.c_kv[BLOCKS, 0].abs().sum() > 0  # the padding rows' latents went here
        assert cache.c_kv[BLOCKS, 1:].abs().sum() == 0


def fake_chunks(rows: list[tuple[int, int, list[int]]]) -> list:
    """(token, position, block table) per row → one-token decode chunks."""
    return [Chunk(types.SimpleNamespace(block_table=table), pos, [token], decode=True) for token, pos, table in rows]


def test_padding_rows_write_the_scratch_block_only(tiny_model, byte_tokenizer):
    """(c) A step of 5 rows after one of 8 (one capture size): rows 5…7 of the static buffers are padding rows again,
    not the larger step's stale rows, and the pools change only at the 5 rows' slots and the scratch block."""
    with forced_gpu_path(), torch.inference_mode():
        runner = LLM(tiny_model, byte_tokenizer, **engine_args()).engine.runner
        graphs = runner.graphs
        tables = [[2 * i, 2 * i + 1] for i in range(8)]  # sequence i: blocks 2i, 2i+1
        graphs(fake_chunks([(10 + i, 9, tables[i]) for i in range(8)]))
        before = [c.c_kv.clone() for c in runner.caches]
        logits = graphs(fake_chunks([(20 + i, 10, tables[i]) for i in range(5)]))
        assert logits.shape == (5, tiny_model.cfg.vocab_size)
        size, scratch = 8, graphs.scratch_block * BLOCK_SIZE
        ids, positions, slots = graphs.inputs[:size], graphs.inputs[size:2 * size], graphs.inputs[2 * size:3 * size]
        assert ids.tolist() == [20, 21, 22, 23, 24, 0, 0, 0] and positions.tolist() == [10] * 5 + [0] * 3
        assert slots.tolist() == [2 * i * BLOCK_SIZE + BLOCK_SIZE + 2 for i in range(5)] + [scratch] * 3
        assert graphs.tables[:5, :2].tolist() == tables[:5] and (graphs.tables[5:8] == graphs.scratch_block).all()
        for cache, old in zip(runner.caches, before, strict=True):
            changed = (cache.c_kv != old).any(-1).flatten().nonzero().flatten().tolist()  # slots written anew
            assert set(changed) <= {*slots[:5].tolist(), scratch}
            assert set(slots[:5].tolist()) <= set(changed)


def test_decode_step_is_sync_free(tiny_model, byte_tokenizer):
    """(b) The graphed step's input copies and replay dispatch no host sync; the whole engine step reads the device
    once, the sampled ids' .tolist(). The step's ops are bounded (CPU-run GPU path: the replayed step's ops are the
    kernels a CUDA graph replays with one launch)."""
    with forced_gpu_path():
        engine = LLM(tiny_model, byte_tokenizer, **engine_args()).engine
        for n in (5, 11, 3):
            engine.add_request(list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()  # the prefills
        with HostSyncGuard(strict=False) as guard:
            engine.step()  # a decode step of 3 rows, padded to 4
        print("engine step:", guard.summary())
        assert dict(guard.sync_counts) == {"Tensor.tolist": 1}
        seqs = list(engine.scheduler.running)
        chunks = [Chunk(s, s.num_tokens - 1, [s.token_ids[-1]], decode=True) for s in seqs]
        with torch.inference_mode(), HostSyncGuard(strict=True) as guard:
            logits = engine.runner.graphs(chunks)
        print("graphed step:", guard.summary())
        assert logits.shape == (3, tiny_model.cfg.vocab_size) and guard.ops <= MAX_STEP_OPS
        temperature = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, max_tokens=8, ignore_eos=True)
        for seq in seqs:
            seq.params = temperature
        with HostSyncGuard(strict=False) as guard:
            engine.step()  # sampled rows: temperature, top-k, top-p, min-p
        assert dict(guard.sync_counts) == {"Tensor.tolist": 1}


def test_multi_step_scheduling_replays_graphs(tiny_model, byte_tokenizer, eager_short, graphed_rows):
    """num_scheduler_steps: each of the N steps replays a graph, and its logits (read for the logprobs once the N steps
    ran) are kept apart from the next step's, which the graph writes to the same buffer."""
    with forced_gpu_path():
        engine = LLM(tiny_model, byte_tokenizer, **engine_args(num_scheduler_steps=4)).engine
        got = run(engine, SHORT, logprobs=True)
    assert graphed_rows
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, eager_short, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-4)


def test_pools_allocated_anew_are_captured_again(tiny_model, byte_tokenizer, eager_short):
    """A GRPO rollout frees the pools between steps and allocates them anew (rl/rollout.py): the graphs, bound to the
    old pools, are captured again on the new ones before the next step."""
    with forced_gpu_path():
        engine = LLM(tiny_model, byte_tokenizer, **engine_args()).engine
        for cache in engine.runner.caches:
            cache.c_kv, cache.k_pe = torch.zeros_like(cache.c_kv), torch.zeros_like(cache.k_pe)
        got = run(engine, SHORT)
        assert engine.runner.graphs.pools[0][0] is engine.runner.caches[0].c_kv
    assert got == [tokens for tokens, _ in eager_short]


def test_graphs_only_where_they_apply(tiny_model, byte_tokenizer, caplog):
    """Off the GPU path, with cuda_graphs=False, LoRA, int8 latents or speculative decoding: no graphs (and the pools
    keep the block manager's blocks); the reason is logged once."""
    assert LLM(tiny_model, byte_tokenizer, **engine_args()).engine.runner.graphs is None  # the CPU path
    with forced_gpu_path():
        for kwargs, why in [(dict(cuda_graphs=False), None), (dict(enable_lora=True), "LoRA"),
                            (dict(kv_cache_dtype="int8"), "int8"), (dict(speculative_tokens=1), "speculative")]:
            caplog.clear()
            runner = LLM(tiny_model, byte_tokenizer, **engine_args(**kwargs)).engine.runner
            assert runner.graphs is None and runner.caches[0].c_kv.shape[0] == BLOCKS
            assert why is None or why in caplog.text


@pytest.mark.parametrize("kwargs", [dict(max_cuda_graph_batch=0), dict(max_cuda_graph_batch=2.5),
                                    dict(cuda_graphs="no")])
def test_config_is_checked(kwargs):
    with pytest.raises(ValueError, match="EngineConfig"):
        EngineConfig(**kwargs)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35
