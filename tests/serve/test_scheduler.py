"""Scheduler decisions without a model: token budget, chunked prefill mixed with decodes,
max_num_seqs, and preemption by recompute."""

from __future__ import annotations

from seekforge.config import EngineConfig
from seekforge.serve.block_manager import BlockManager
from seekforge.serve.scheduler import Scheduler
from seekforge.serve.sequence import SamplingParams, Sequence, Status


def make(num_blocks=64, block_size=4, **kw):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **kw)
    return Scheduler(config, BlockManager(num_blocks, block_size, config.enable_prefix_caching))


def seq(n, start=0):
    return Sequence("r", 0, list(range(start, start + n)), SamplingParams(max_tokens=100), 100, None)


def finish_step(sched: Scheduler, batch) -> None:
    """What the engine does after the model ran: count computed tokens, append a sampled token."""
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        sched.block_manager.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def test_chunked_prefill_mixes_with_decodes():
    sched = make(max_num_batched_tokens=16)
    short = seq(3)
    sched.add(short)
    finish_step(sched, sched.schedule())  # short prefilled, now decoding
    long = seq(40, start=100)
    sched.add(long)
    batch = sched.schedule()
    assert batch.seqs == [short, long] and batch.num_new_tokens == [1, 15]  # decode + a prefill chunk
    finish_step(sched, batch)
    assert long.num_computed_tokens == 15 and long.num_tokens == 40  # no token sampled mid-prefill
    for _ in range(2):
        finish_step(sched, sched.schedule())
    assert long.num_computed_tokens == 40 and long.num_output_tokens == 1


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    a, b = seq(20), seq(20, start=50)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a]  # b does not fit in the remaining 12 tokens and is not split
    finish_step(sched, batch)
    assert sched.schedule().seqs == [a, b]


def test_max_num_seqs():
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(4, start=10 * i))
    assert len(sched.schedule().seqs) == 2 and len(sched.waiting) == 1


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = seq(7), seq(7, start=50)  # 2 blocks each: the cache is full after both prefill
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())
    assert a.num_tokens == 8 and b.num_tokens == 8
    finish_step(sched, sched.schedule())  # both decode into their 2nd block (slot 8 of 8)
    batch = sched.schedule()  # a needs a 3rd block: b (the newest) is preempted
    assert batch.seqs == [a] and batch.num_preempted == 1
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert sched.waiting[0] is b and b.num_tokens == 9  # keeps its generated tokens for the recompute
    sched.finish(a, "stop")
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [9]  # recomputes prompt + output


def test_decodes_never_wait_behind_a_prefill():
    """Random arrivals and prompt lengths: every step schedules every running decode, and at most one
    sequence (the last) runs a partial prefill chunk."""
    import random

    rng = random.Random(0)
    sched = make(num_blocks=512, max_num_batched_tokens=24)
    for step in range(300):
        if step % 3 == 0:
            sched.add(seq(rng.randint(1, 60), start=rng.randrange(1000)))
        decoding = {s.seq_id for s in sched.running if s.num_tokens - s.num_computed_tokens == 1}
        batch = sched.schedule()
        assert decoding <= {s.seq_id for s in batch.seqs}
        partial = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True))
                   if s.num_computed_tokens + n < s.num_tokens]
        assert partial in ([], [len(batch.seqs) - 1])
        finish_step(sched, batch)
        for s in list(sched.running):
            if s.num_output_tokens >= 5:
                sched.finish(s, "length")


def test_admission_allocates_blocks_under_python_O():
    """Asserts vanish under `python -O`; admitting a sequence must still give it its blocks."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        from seekforge.config import EngineConfig
        from seekforge.serve.block_manager import BlockManager
        from seekforge.serve.scheduler import Scheduler
        from seekforge.serve.sequence import SamplingParams, Sequence

        assert False, "unreachable under -O"  # proves the asserts really are gone
        config = EngineConfig(block_size=4, num_kv_blocks=8)
        sched = Scheduler(config, BlockManager(8, 4))
        s = Sequence("r", 0, list(range(10)), SamplingParams(max_tokens=4), 4, None)
        sched.add(s)
        batch = sched.schedule()
        print(batch.num_new_tokens, len(s.block_table), sched.block_manager.num_free_blocks)
    """)
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "[10] 3 5"  # 10 tokens need 3 blocks of 4; 5 of 8 stay free
