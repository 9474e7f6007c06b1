"""ShardedRunner: the Runner of one rank of an attention-TP group (serve/distributed.py). The replica's
leader announces each forward, or the idle batch, over the TP group; the group's other ranks `follow`
it with the same chunks and block ids on their shards of the weights, so the all-reduces of
parallel/serving.py pair up."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from seekforge.config import EngineConfig
from seekforge.serve.runner import Chunk, Runner


@dataclass
class _BlockTable:
    """What Runner.prepare reads of a chunk's sequence, for a TP rank that holds no Sequence objects."""

    block_table: list[int]
    seq_id: int  # the leader's: the dense decode rows (kv_cache.DenseRows) follow it on every rank
    lora: None = None


class ShardedRunner(Runner):
    """A Runner on one rank of a TP group. The leader announces each forward (or the idle batch) to the
    group's other ranks, which `follow` it."""

    def __init__(self, model, config: EngineConfig, num_blocks: int, groups):
        super().__init__(model, config, num_blocks)
        self.groups = groups
        self.ran = False  # did the leader's engine step run the model?

    def _announce(self, message):
        if self.groups.tp == 1:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=self.groups.leader, group=self.groups.tp_group)
        return box[0]

    def execute(self, chunks: list[Chunk], head_rows: list[int]) -> torch.Tensor:
        self.ran = True
        self._announce(("run", [(c.start, c.token_ids, list(c.seq.block_table), c.seq.seq_id, c.decode)
                                for c in chunks], head_rows))
        return super().execute(chunks, head_rows)

    def idle(self) -> None:
        self._announce(("idle",))
        self._dummy_forward()

    @torch.inference_mode()
    def follow(self) -> None:
        """A non-leader TP rank: run what the leader announces (same chunks, same block ids: every TP
        rank keeps the whole latent cache, see parallel/serving.py)."""
        message = self._announce(None)
        if message[0] == "idle":
            self._dummy_forward()
            return
        _, plan, head_rows = message
        chunks = [Chunk(_BlockTable(table, seq_id), start, ids, decode) for start, ids, table, seq_id, decode in plan]
        super().execute(chunks, head_rows)

    @torch.inference_mode()
    def _dummy_forward(self) -> None:
        """One token through every layer without a cache: no KV state changes, the collectives run."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.model.hidden(ids, positions=torch.zeros(1, dtype=torch.long, device=self.device))
