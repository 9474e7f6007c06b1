"""The distributed engine (serve/distributed.py on parallel/serving.py's layouts) on gloo ranks: greedy
outputs equal the single-device engine token for token, for several concurrent requests of different
lengths (chunked prefills, several KV blocks each), under attention TP, attention DP + EP, and TP + EP.
Every rank reads only its own slices of an HF checkpoint."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import model_config
from dist_launcher import launch

from seekforge.config import EngineConfig
from seekforge.model.model import build_model
from seekforge.serve.sequence import SamplingParams

ENGINE = dict(block_size=8, num_kv_blocks=48, max_num_batched_tokens=24)  # prompts prefill in chunks
PROMPT_LENGTHS, MAX_TOKENS = (3, 11, 20, 37), (9, 12, 5, 10)


def prompts(cfg) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from seekforge.model.hf import save_hf

    path = tmp_path_factory.mktemp("serve_parallel") / "tiny"
    save_hf(build_model(model_config(), seed=0), path)
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from seekforge.serve.engine import LLM

    llm = LLM(checkpoint, dtype=torch.float32, **ENGINE)
    outs = llm.generate(prompts(model_config()), [params(m) for m in MAX_TOKENS])
    return [o.outputs[0].token_ids for o in outs]


LAYOUTS = {"tp2": (2, 1, 1), "dp-attention2+ep2": (1, 2, 2), "tp2+ep2": (2, 1, 2)}  # (tp, dp_attention, ep)


def _serve(checkpoint: str, tp: int, dp_attention: int, ep: int):
    from seekforge.serve.distributed import start

    torch.manual_seed(dist.get_rank())  # greedy must not depend on any rank's random state
    engine = start(checkpoint, tp, dp_attention, ep, torch.float32, EngineConfig(**ENGINE))
    if engine is None:  # a worker rank: served until rank 0 stopped it
        return None
    held = sum(t.numel() for t in engine.model.state_dict().values())
    ids = [engine.add_request(p, params(m)) for p, m in zip(prompts(engine.model.cfg), MAX_TOKENS, strict=True)]
    replicas = [engine.owner[i] for i in ids]  # all in flight at once
    aborted = engine.add_request(prompts(engine.model.cfg)[3], params(30))
    engine.step()
    engine.abort(aborted)  # reaches its replica before the next step, which frees its blocks
    outs = engine.drain(ids)
    stats = engine.stats()
    engine.shutdown()
    return {"tokens": [o.outputs[0].token_ids for o in outs], "replicas": replicas, "held": held, "stats": stats,
            "idle": not engine.has_unfinished()}


def _uneven_vocab_logits_error() -> float:
    """TP=2 with a vocab that does not split evenly (509 rows: 255 + 254): the masked embedding lookup
    and the padded logits all-gather against the unsharded model, whole sequences without a cache."""
    import copy

    from seekforge.parallel.layout import describe_engine_layout
    from seekforge.parallel.serving import engine_groups, shard_for_serving

    cfg = model_config(vocab_size=509)
    full = build_model(cfg, seed=0).eval()
    sharded = shard_for_serving(copy.deepcopy(full), describe_engine_layout(cfg, tp=2), engine_groups(2, 1, 1))
    ids = torch.arange(0, cfg.vocab_size, 23)[None]  # ids on both ranks' halves
    with torch.inference_mode():
        return (sharded(ids) - full(ids)).abs().max().item()


def _serve_layouts(checkpoint: str) -> dict:
    """Each layout in turn on the same two ranks (one spawn for all of it: the CPU is shared)."""
    out = {name: _serve(checkpoint, *layout) for name, layout in LAYOUTS.items()}
    out["uneven_vocab_error"] = _uneven_vocab_logits_error()
    return out


def test_distributed_engine_greedy_equals_single_device(checkpoint, reference):
    rank0 = launch(_serve_layouts, 2, checkpoint)[0]
    full = sum(t.numel() for t in build_model(model_config(), device="meta").state_dict().values())
    for name, (_, dp_attention, _) in LAYOUTS.items():
        result = rank0[name]
        assert result["tokens"] == reference, name
        assert result["held"] < full, name  # rank 0 holds its shards, not the model
        if dp_attention > 1:  # every replica served requests
            assert sorted(set(result["replicas"])) == list(range(dp_attention)), name
        assert result["stats"]["num_running"] == result["stats"]["num_waiting"] == 0 and result["idle"], name
        assert result["stats"]["num_replicas"] == dp_attention
    assert rank0["uneven_vocab_error"] < 1e-5


def _train_then_sync(checkpoint: str, tp: int, dp_attention: int, ep: int):
    """The GRPO trainer's policy layout under torchrun (FSDP2 over both ranks, rl/collectives.shard_policy)
    takes one optimizer step; its weights then reach an engine in another layout in memory."""
    from dist_harness import batches

    from seekforge.model.dtensor import plain_tensor
    from seekforge.model.loss import lm_loss
    from seekforge.rl.collectives import shard_policy
    from seekforge.serve.distributed import DistributedEngine, build

    cfg, rank = model_config(), dist.get_rank()
    policy = build_model(cfg, seed=0)
    shard_policy(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-2)
    inputs, labels = batches(cfg, steps=1)
    lm_loss(policy, inputs[0], labels[0])[0].backward()
    optimizer.step()
    trained = {k: plain_tensor(v).detach().clone() for k, v in policy.state_dict().items()}
    rank_engine = build(checkpoint, tp, dp_attention, ep, torch.float32, EngineConfig(**ENGINE))  # seed 0, from disk
    engine = DistributedEngine(rank_engine) if rank == 0 else None

    def generate():
        if engine is None:
            rank_engine.follow_forever()
            return None
        outs = engine.generate(prompts(cfg), [params(m) for m in MAX_TOKENS])
        engine.shutdown()  # the workers leave follow_forever: every rank is free for the sync
        return [o.outputs[0].token_ids for o in outs]

    before = generate()
    stats = rank_engine.sync_weights(policy)
    after = generate()
    return {"before": before, "after": after, "trained": trained if rank == 0 else None, "stats": stats}


def test_trainer_weights_sync_into_engine_in_memory(checkpoint, reference):
    from seekforge.serve.engine import LLM

    results = launch(_train_then_sync, 2, checkpoint, 1, 2, 2)
    rank0 = results[0]
    assert rank0["before"] == reference  # the engine started from the checkpoint
    model = build_model(model_config(), seed=1)
    model.load_state_dict(rank0["trained"])
    fresh = LLM(model.eval(), **ENGINE).generate(prompts(model.cfg), [params(m) for m in MAX_TOKENS])
    assert rank0["after"] == [o.outputs[0].token_ids for o in fresh]
    assert rank0["after"] != rank0["before"]  # the sync changed what the engine serves
    moved = sum(r["stats"].bytes_sent for r in results)
    assert moved == sum(r["stats"].bytes_received for r in results) == rank0["stats"].bytes_moved > 0
    print(f"FSDP2 -> dp-attention2+ep2 engine: {moved} B in {max(r['stats'].seconds for r in results):.3f} s")
