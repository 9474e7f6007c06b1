"""Continuous batching: which sequences run this step, and on how many tokens each.

Every sequence is "N tokens known, C of them computed"; a step runs each scheduled sequence on its
next `min(N - C, budget)` tokens. A decode is the case N - C = 1; a prefill chunk is any larger
count. So prefills and decodes share a step under one token budget (`max_num_batched_tokens`), and a
long prompt is split across steps (chunked prefill) without special cases.

Order: running sequences first (in arrival order), then waiting ones while the budget, the
`max_num_seqs` limit and free blocks allow. A prompt that does not fit takes all the budget left, so
nothing is admitted behind an unfinished prefill: it is always last in the running queue, takes
what the decodes leave, and never stalls them (test_decodes_never_wait_behind_a_prefill).

With speculative decoding a decode also runs its draft tokens (spec_decode.py); drafts past the budget
are dropped. With `num_scheduler_steps` N, an all-decode batch may run N steps (`num_decode_steps`).

When a running sequence needs a block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it goes back to the front of the queue to be recomputed later
(prompt + the tokens it already generated), so no request is ever lost. Full blocks it computed stay
in the prefix cache and usually make the recompute cheap.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from seekforge.config import EngineConfig
from seekforge.serve.block_manager import BlockManager
from seekforge.serve.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens this step computes
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def drop_drafts(seq: Sequence, keep: int) -> None:
    """Keep only seq's first `keep` draft tokens (and their distributions)."""
    keep = max(keep, 0)
    if len(seq.draft_token_ids) > keep:
        del seq.draft_token_ids[keep:]
        if seq.draft_probs is not None:
            seq.draft_probs = seq.draft_probs[:keep]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        batch = ScheduledBatch([], [])
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens + len(seq.draft_token_ids), budget)
            drop_drafts(seq, num_new - (seq.num_tokens - seq.num_computed_tokens))  # those past the budget
            while not bm.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        if batch.num_preempted:  # out of blocks: admitting more would only preempt again
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit_blocks, hit_hashes = bm.match_prefix(seq)
            num_new = seq.num_tokens - len(hit_blocks) * bm.block_size
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break  # the whole prompt must fit one step; wait for a step with room
                num_new = budget
            if not bm.can_admit(seq, hit_blocks, num_new):
                break
            self.waiting.popleft()
            bm.admit(seq, hit_blocks, hit_hashes)
            allocated = bm.allocate(seq, num_new)  # outside the assert: `python -O` strips asserts
            assert allocated, "can_admit promised the blocks"
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def num_decode_steps(self, batch: ScheduledBatch, max_model_len: int) -> int:
        """How many decode steps this pass may run (`num_scheduler_steps`, multi-step scheduling): 1 unless
        every scheduled sequence decodes, nothing waits for admission, no sequence needs Python-side
        state between steps (penalties count the output, min_tokens masks stop tokens, a grammar's
        matcher must consume each token before it masks the next), and each has
        room: at most its remaining tokens, with blocks pre-allocated for all of them."""
        num_steps = self.config.num_scheduler_steps
        if num_steps == 1 or self.waiting:
            return 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if n != 1 or seq.num_computed_tokens != seq.num_tokens - 1 or seq.params.has_penalties or \
                    seq.num_output_tokens < seq.params.min_tokens or seq.matcher is not None:
                return 1
            num_steps = min(num_steps, seq.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        if num_steps > 1 and all(self.block_manager.allocate(seq, num_steps) for seq in batch.seqs):
            return num_steps
        return 1  # blocks a sequence did get stay allocated; its next steps use them

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        drop_drafts(seq, 0)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and release its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        drop_drafts(seq, 0)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
