"""Block bookkeeping for the paged latent KV cache, with prefix caching.

The cache is `num_blocks` blocks of `block_size` token slots (the tensors live in runner.py; this file
only hands out block ids). A block is ref-counted: sequences that share a cached prefix share its
blocks. A block whose ref count drops to 0 goes to the back of `free_blocks` (an LRU queue) but keeps
its contents and its hash, so a later request with the same prefix can take it back; allocation
takes from the front, evicting the least recently freed block's hash.

Prefix keys chain: hash(block i) = sha256(hash(block i-1) ‖ token ids of block i ‖ extra keys), so a
block matches only if every token before it matches too. A hit also compares the stored token ids,
and the parent hash is part of the key, so a wrong hit needs a sha256 collision.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from seekforge.serve.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int], extra: str | None) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(extra.encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_blocks
        self.tokens_of_block: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash → block id
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding a prefix of seq's tokens. The last token is never matched: the model
        must run on at least one token to produce the next-token logits. A sequence that wants prompt
        logprobs matches nothing (as in vLLM): a cached block's logits were never kept."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return [], []
        blocks, hashes, parent = [], [], b""
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(parent, tokens, seq.cache_key)
            block = self.cached.get(h)
            if block is None or self.tokens_of_block[block] != tuple(tokens):
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def can_admit(self, seq: Sequence, hit_blocks: list[int], num_new_tokens: int) -> bool:
        """Room for seq's prefix hits plus `num_new_tokens` past them? Hit blocks sitting in the free
        queue are taken out of it, so they count against the free blocks too."""
        revived = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)
        num_tokens = len(hit_blocks) * self.block_size + num_new_tokens
        fresh = -(-num_tokens // self.block_size) - len(hit_blocks)
        return revived + fresh <= len(self.free_blocks)

    def admit(self, seq: Sequence, hit_blocks: list[int], hit_hashes: list[bytes]) -> None:
        """Give a waiting sequence (no blocks yet) its prefix-cache hits."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        for b in hit_blocks:
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]
            self.ref_counts[b] += 1
        seq.block_table = list(hit_blocks)
        seq.block_hashes = list(hit_hashes)
        seq.num_computed_tokens = len(hit_blocks) * self.block_size
        if seq.num_preemptions == 0:  # a recompute after preemption is not a new prompt lookup
            seq.num_cached_tokens = seq.num_computed_tokens
            self.num_queried_tokens += seq.num_prompt_tokens
            self.num_hit_tokens += seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens under their chained hash."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(parent, tokens, seq.cache_key)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.cached:  # an identical block computed by another sequence stays first
                self.cached[h] = block
                self.hash_of_block[block] = h
                self.tokens_of_block[block] = tuple(tokens)

    # ------------------------------------------------------------------ allocation
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make seq's block table cover `num_new_tokens` more tokens; False (and no change) if the
        free blocks do not suffice."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_blocks):
            return False
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)  # least recently freed
            self._evict(block)
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks go to the free queue first, so they are evicted before
        the (more shareable) head of the prefix."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, block
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a weight update the cached latents are stale)."""
        if len(self.free_blocks) != self.num_blocks:
            raise ValueError(f"{self.num_blocks - len(self.free_blocks)} blocks are still in use; reset the "
                             "prefix cache only when no request is running")
        for block in range(self.num_blocks):
            self._evict(block)

    def _evict(self, block: int) -> None:
        h = self.hash_of_block[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hash_of_block[block] = None
            self.tokens_of_block[block] = None
