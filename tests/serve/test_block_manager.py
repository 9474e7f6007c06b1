"""BlockManager: ref counts, prefix hits, LRU eviction, and that a hash collision cannot return the
wrong cached block."""

from __future__ import annotations

from seekforge.serve import block_manager as bm_module
from seekforge.serve.block_manager import BlockManager
from seekforge.serve.sequence import SamplingParams, Sequence


def seq(tokens, salt=None):
    return Sequence("r", 0, tokens, SamplingParams(max_tokens=4), 4, None, salt)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """Admit s with its prefix hits and 'compute' the rest of its tokens."""
    hits, hashes = bm.match_prefix(s)
    bm.admit(s, hits, hashes)
    num_new = s.num_tokens - s.num_computed_tokens
    assert bm.allocate(s, num_new)
    s.num_computed_tokens += num_new
    bm.cache_full_blocks(s)


def test_allocate_free_and_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    run_prefill(bm, s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert len(s.block_hashes) == 2  # only full blocks are hashed
    bm.free(s)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in bm.ref_counts)


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(12)))
    run_prefill(bm, a)
    b = seq(list(range(12)))  # identical: 2 blocks hit (the last token must be computed)
    run_prefill(bm, b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    c = seq(list(range(6)) + [99] * 6)  # shares only the first block
    run_prefill(bm, c)
    assert c.num_cached_tokens == 4
    d = seq(list(range(12)), salt="other-tenant")  # extra keys separate caches
    run_prefill(bm, d)
    assert d.num_cached_tokens == 0
    assert bm.prefix_hit_rate == (8 + 4) / (4 * 12)


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)))  # 3 blocks, 2 full
    run_prefill(bm, a)
    bm.free(a)
    b = seq(list(range(9)))
    run_prefill(bm, b)
    assert b.num_cached_tokens == 8  # revived from the free queue
    bm.free(b)
    other = seq([50 + i for i in range(16)])  # takes all 4 blocks: evicts every cached hash
    assert bm.allocate(other, 16)
    assert not bm.cached
    bm.free(other)
    c = seq(list(range(9)))
    hits, _ = bm.match_prefix(c)
    assert hits == []


def test_allocate_refuses_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_hash_collision_cannot_return_wrong_blocks(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens, extra: b"same")  # every block collides
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9])
    hits, _ = bm.match_prefix(b)
    assert hits == []  # the stored tokens differ, so the colliding entry is refused
