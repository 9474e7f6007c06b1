"""Runner: a scheduled batch in, next-token logits out.

It owns the model and the per-layer paged latent caches, turns the scheduler's (sequence, number of
new tokens) pairs into one flat batch plus `AttentionMetadata`, runs the model, and returns logits
only for the sequences whose chunk reaches their last known token (those sample a token this step;
a sequence in the middle of a chunked prefill does not).
"""

from __future__ import annotations

import logging

import torch

from seekforge.config import EngineConfig
from seekforge.model.model import Transformer
from seekforge.serve.kv_cache import AttentionMetadata, PagedLatentCache, bytes_per_block
from seekforge.serve.scheduler import ScheduledBatch
from seekforge.serve.sequence import Sequence

log = logging.getLogger("seekforge.serve")


def num_kv_blocks(model: Transformer, config: EngineConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    dtype = torch.int8 if config.kv_cache_dtype == "int8" else model.embed_tokens.weight.dtype
    n = config.kv_cache_bytes // bytes_per_block(model.cfg, config.block_size, dtype)
    if n < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory!r} holds no block of "
                         f"{bytes_per_block(model.cfg, config.block_size, dtype)} bytes; give more memory")
    return n


class Runner:
    def __init__(self, model: Transformer, config: EngineConfig, num_blocks: int):
        self.model = model
        self.block_size = config.block_size
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.caches = [PagedLatentCache(model.cfg, num_blocks, config.block_size, weight.dtype, weight.device,
                                        int8=config.kv_cache_dtype == "int8") for _ in model.layers]

    def prepare(self, batch: ScheduledBatch):
        """→ input ids (1, T), positions (T,), AttentionMetadata, sample rows (N,) = flat index of the last
        token of each sequence that samples this step, and those N sequences. Sequences are laid out
        decodes first (see kv_cache.py)."""
        decodes, prefills = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            (decodes if n == 1 and seq.num_computed_tokens > 0 else prefills).append((seq, n))
        order = decodes + prefills
        bs = self.block_size
        input_ids, starts, tables, sample_rows, sample_seqs = [], [], [], [], []
        flat = 0
        for seq, n in order:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            starts.append(start)
            tables.append(seq.block_table)
            flat += n
            if start + n == seq.num_tokens:
                sample_rows.append(flat - 1)
                sample_seqs.append(seq)
        # Vectorized slot mapping: token k of sequence j sits at block_table[j][pos // L] · L + pos % L.
        max_blocks = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        lens = torch.tensor([n for _, n in order])
        starts = torch.tensor(starts)
        seq_of_token = torch.repeat_interleave(torch.arange(len(order)), lens)  # (T,)
        offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        pos = starts[seq_of_token] + offsets  # (T,)
        slots = table[seq_of_token, pos // bs] * bs + pos % bs
        nd = len(decodes)
        decode_tables = decode_mask = None
        if nd:
            width = max(len(s.block_table) for s, _ in decodes)
            decode_tables = table[:nd, :width]
            context_lens = starts[:nd] + 1
            decode_mask = (torch.arange(width * bs) < context_lens[:, None])[:, None, None, :]
        prefill_tables = [table[nd + i, :-(-(seq.num_computed_tokens + n) // bs)]
                          for i, (seq, n) in enumerate(prefills)]
        to = self.device
        metadata = AttentionMetadata(
            slot_mapping=slots.to(to), num_decodes=nd,
            decode_block_tables=None if decode_tables is None else decode_tables.to(to),
            decode_mask=None if decode_mask is None else decode_mask.to(to),
            prefill_block_tables=[t.to(to) for t in prefill_tables],
            prefill_query_lens=[n for _, n in prefills],
            prefill_context_lens=[seq.num_computed_tokens + n for seq, n in prefills],
            # query i of a chunk sits at position context_len - q_len + i and sees keys up to it
            prefill_masks=[torch.ones(n, seq.num_computed_tokens + n, dtype=torch.bool, device=to)
                           .tril(seq.num_computed_tokens) for seq, n in prefills],
        )
        ids = torch.tensor([input_ids], dtype=torch.long, device=to)
        return ids, pos.to(to), metadata, torch.tensor(sample_rows, device=to), sample_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """→ logits (N, V) fp32 for the N sequences that sample this step, and those sequences."""
        ids, positions, metadata, sample_rows, sample_seqs = self.prepare(batch)
        for cache in self.caches:
            cache.metadata = metadata
        model = self.model
        hidden, _, _ = model.hidden(ids, positions=positions, kv_caches=self.caches)  # (1, T, H)
        if not sample_seqs:
            return hidden.new_empty(0, model.cfg.vocab_size).float(), []
        last = hidden[0, sample_rows]  # only the sampled rows reach the head
        return model.lm_head(model.norm(last)).float(), sample_seqs
