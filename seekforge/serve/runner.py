"""Runner: chunks of sequences in, hidden states and next-token logits out.

It owns the model and the per-layer paged latent caches (plus one per MTP module when speculative
decoding drafts with them), turns a list of `Chunk`s — the tokens of one sequence a pass computes —
into one flat batch plus `AttentionMetadata`, and runs the main model or an MTP module over it.
`run` is the plain step: logits only for the sequences whose chunk reaches their last known token
(those sample a token this step; a sequence in the middle of a chunked prefill does not), and for a
sequence that asked for prompt logprobs the logits of its chunk's rows that predict a prompt token.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from seekforge.config import EngineConfig
from seekforge.model import pages
from seekforge.model.gpu import gpu_path, triton_ready
from seekforge.model.model import Transformer
from seekforge.model.precision import onednn
from seekforge.serve.compiled import CompiledDecode
from seekforge.serve.graphs import GraphedDecode
from seekforge.serve.kv_cache import (
    AttentionMetadata,
    DenseRows,
    GatherScratch,
    PagedLatentCache,
    bytes_per_block,
    fresh_runs,
    plain_decode_rows,
)
from seekforge.serve.lora import LoRAManager
from seekforge.serve.scheduler import ScheduledBatch
from seekforge.serve.sequence import Sequence

log = logging.getLogger("seekforge.serve")


@dataclass
class Chunk:
    """Tokens of `seq` at positions start … start + len(token_ids) - 1, computed in one pass.
    decode: every token is a decode row (absorbed MLA against the cache: decodes, speculative
    verifies, MTP drafts); else one causal prefill chunk (naive MLA)."""

    seq: Sequence
    start: int
    token_ids: list[int]
    decode: bool


def num_kv_blocks(model: Transformer, config: EngineConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    dtype = torch.int8 if config.kv_cache_dtype == "int8" else model.embed_tokens.weight.dtype
    per_block = bytes_per_block(model.cfg, config.block_size, dtype)
    if config.speculative_tokens:  # the MTP modules keep a latent cache each, on the same block tables
        per_block += per_block * len(model.mtp) // model.cfg.num_hidden_layers
    n = config.kv_cache_bytes // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory!r} holds no block of {per_block} bytes; "
                         "give more memory")
    return n


def chunks_of(batch: ScheduledBatch) -> list[Chunk]:
    """The scheduler's (sequence, new tokens) pairs as chunks: a sequence with everything but its last
    token cached decodes; one with drafts verifies them (see spec_decode.py); the rest prefill."""
    chunks = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        real = min(n, seq.num_tokens - start)  # the rest of n are drafts
        tokens = seq.token_ids[start:start + real] + seq.draft_token_ids[:n - real]
        chunks.append(Chunk(seq, start, tokens, decode=start > 0 and real == 1))
    return chunks


def flat_order(chunks: list[Chunk]) -> list[Chunk]:
    """The order of chunks in a step's flat batch: decode rows first (see kv_cache.py)."""
    return [c for c in chunks if c.decode] + [c for c in chunks if not c.decode]


def first_rows(chunks: list[Chunk]) -> list[int]:
    """The flat row of each chunk's first token, in the order given."""
    first, flat = {}, 0
    for c in flat_order(chunks):
        first[id(c)] = flat
        flat += len(c.token_ids)
    return [first[id(c)] for c in chunks]


def prompt_rows(chunks: list[Chunk], rows: list[int]) -> list[tuple[Sequence, slice]]:
    """For each chunk (first flat row in `rows`) of a sequence wanting prompt logprobs, the flat rows
    that predict a prompt token not yet scored: the row at position p predicts token p + 1, and a
    recompute after preemption skips the tokens already scored."""
    out = []
    for c, r in zip(chunks, rows, strict=True):
        seq = c.seq
        if seq.params.prompt_logprobs is None:
            continue
        first = max(c.start + 1, len(seq.prompt_logprobs))  # target token positions first … last - 1
        last = min(c.start + len(c.token_ids) + 1, seq.num_prompt_tokens)
        if first < last:
            out.append((seq, slice(r + first - 1 - c.start, r + last - 1 - c.start)))
    return out


def plain_decode_layout(order: list[Chunk], block_size: int, device=None):
    """What Runner._layout computes when every chunk is a one-token decode (every step of steady
    decoding), from Python lists in one tensor: the fixed cost of each small tensor op is most of a batch-1
    step's preparation. → input ids (1, B), positions (B,), slots (B,), block tables (B, width), views of
    one tensor; the key mask (decode_key_mask) is left to the steps that read it."""
    b = len(order)
    flat, width = plain_decode_rows(order, block_size)
    data = torch.tensor(flat, device=device)
    return data[:b][None], data[b:2 * b], data[2 * b:3 * b], data[3 * b:].view(b, width)


def decode_key_mask(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Decode rows' positions (Nd,) → which of `width` cached keys each sees (Nd, 1, 1, width): those up to and
    including its own."""
    return (torch.arange(width, device=positions.device) <= positions[:, None])[:, None, None, :]


class Runner:
    def __init__(self, model: Transformer, config: EngineConfig, num_blocks: int):
        self.model = model
        self.block_size = config.block_size
        weight = model.embed_tokens.weight
        self.device = weight.device
        cfg = model.cfg
        if self.device.type == "cpu":  # a decode step streams the weights: on 2 MiB pages, not 4 KiB ones
            start = time.perf_counter()
            done, tried = pages.collapse([*model.parameters(), *model.buffers()])
            if tried:
                log.info("weights on 2 MiB pages: %.0f of %.0f MiB (%.1f s)", done / 2**20, tried / 2**20,
                         time.perf_counter() - start)
        # the main layers' dense decode rows (kv_cache.py), in the attention dtype, in at most as many
        # bytes as their pools. CPU only: that is where the per-step gather was measured to cost (visibly at
        # serve_throughput.py's 64 requests); on a GPU kv_cache_memory is sized to the device, and a second copy of the
        # latents would not fit beside it (budget 0: every step gathers)
        pool_dtype = torch.int8 if config.kv_cache_dtype == "int8" else weight.dtype
        per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * weight.element_size() * cfg.num_hidden_layers
        budget = num_blocks * bytes_per_block(cfg, config.block_size, pool_dtype) if self.device.type == "cpu" else 0
        self.dense_rows = DenseRows(budget, per_token)
        self.scratch = GatherScratch(self.dense_rows)  # one set of gather outputs for all layers
        graphed = self._graphs_wanted(config)

        def pool(kv_b_name=None, layer=0, blocks=num_blocks):
            return PagedLatentCache(cfg, blocks, config.block_size, weight.dtype, weight.device, kv_b_name,
                                    int8=config.kv_cache_dtype == "int8", scratch=self.scratch, layer=layer)

        # graphed decode steps' padding rows write one block past the block manager's (serve/graphs.py)
        self.caches = [pool(f"layers.{i}.self_attn.kv_b_proj", i, num_blocks + int(graphed))
                       for i in range(len(model.layers))]
        self.mtp_caches = [pool() for _ in model.mtp] if config.speculative_tokens else []
        self.lora: LoRAManager | None = LoRAManager(model) if config.enable_lora else None
        # A one-token step of a bf16 model on a CPU runs its linear layers on torch's own bf16 kernels
        # (precision.onednn: less fixed cost a call, so faster batch-1 decode, measured on an AMX CPU); attention
        # over the cache stays on oneDNN (kv_cache.py). Quantized (integer) weights keep their own kernels;
        # an fp32 router runs on MKL either way.
        self.one_row_native = self.device.type == "cpu" and weight.dtype == torch.bfloat16 and all(
            t.is_floating_point() for t in (*model.parameters(), *model.buffers()) if t.dim() >= 2)
        self.compiled: CompiledDecode | None = None
        if config.compile:
            why_not = CompiledDecode.supports(model, config)
            if why_not:
                log.warning("compile: decoding eagerly (%s)", why_not)
            else:
                compiled = CompiledDecode(model, self.caches)
                self.compiled = compiled if compiled.warm_up() else None
        self.dense_rows.at_once = self.compiled is not None  # compiled steps read dense rows from a set's first step
        self.graphs: GraphedDecode | None = None
        if graphed:
            graphs = GraphedDecode(model, self.caches, num_blocks, config.block_size,
                                   config.model_len(cfg.max_position_embeddings),
                                   min(config.max_cuda_graph_batch, config.max_num_seqs))
            self.graphs = graphs if graphs.warm_up() else None

    def _graphs_wanted(self, config: EngineConfig) -> bool:
        """Do plain decode steps replay CUDA graphs (serve/graphs.py)? On the GPU path, with Triton's kernels
        ready, unless the config turns them off or needs what they do not capture (logged once, at start)."""
        if not (config.cuda_graphs and gpu_path(self.device)):
            return False
        if not triton_ready(self.device):
            log.warning("cuda_graphs: decoding eagerly (Triton is not installed: pip install triton)")
            return False
        why_not = GraphedDecode.supports(self.model, config)
        if why_not:
            log.warning("cuda_graphs: decoding eagerly (%s)", why_not)
        return why_not is None

    def prepare(self, chunks: list[Chunk], dense: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """→ input ids (1, T), positions (T,), AttentionMetadata, and the flat row of each chunk's first
        token (in the order given). Decode rows go first (see kv_cache.py). `dense`: a step of the main
        model, whose plain decode rows may read the dense rows (kv_cache.DenseRows)."""
        order = flat_order(chunks)
        if all(c.decode and len(c.token_ids) == 1 for c in order):
            ids, pos, slots, decode_tables = plain_decode_layout(order, self.block_size, self.device)
            decode_mask = None  # below, unless the dense rows make it unneeded
            nd, decodes, prefills, prefill_tables = len(order), order, [], []
        else:
            pos, slots, decode_tables, decode_mask, prefill_tables = self._layout(order)
            decodes = [c for c in order if c.decode]
            prefills = order[len(decodes):]
            nd = sum(len(c.token_ids) for c in decodes)  # decode rows
            ids = torch.tensor([[t for c in order for t in c.token_ids]], dtype=torch.long)
        to = self.device
        metadata = AttentionMetadata(
            slot_mapping=slots.to(to), num_decodes=nd,
            decode_block_tables=None if decode_tables is None else decode_tables.to(to),
            decode_mask=None if decode_mask is None else decode_mask.to(to),
            prefill_block_tables=[t.to(to) for t in prefill_tables],
            prefill_query_lens=[len(c.token_ids) for c in prefills],
            prefill_context_lens=[c.start + len(c.token_ids) for c in prefills],
            # query i of a chunk sits at position context_len - q_len + i and sees keys up to it
            prefill_masks=[torch.ones(len(c.token_ids), c.start + len(c.token_ids), dtype=torch.bool, device=to)
                           .tril(c.start) for c in prefills],
        )
        if len(prefills) > 1:
            metadata.prefill_runs = fresh_runs(metadata.prefill_query_lens, [c.start for c in prefills],
                                               self.model.cfg.num_attention_heads, to)
        if dense:
            if nd and nd == len(decodes):  # every decode row a plain one-token decode
                metadata.dense = self.dense_rows.plan([c.seq.seq_id for c in decodes], [c.start for c in decodes], to)
            else:
                self.dense_rows.invalidate()
        if nd and metadata.decode_mask is None and (metadata.dense is None or not metadata.dense.uniform):
            metadata.decode_mask = decode_key_mask(pos[:nd], decode_tables.shape[1] * self.block_size).to(to)
        self._set_lora(metadata, [c.seq for c in order], [len(c.token_ids) for c in order], nd)
        return ids.to(to), pos.to(to), metadata, first_rows(chunks)

    def _layout(self, order: list[Chunk]):
        """Chunks in flat order → positions (T,), slots (T,), decode block tables (Nd, width) and mask
        (Nd, 1, 1, width·L) (None without decode rows), per prefill chunk its block table."""
        bs = self.block_size
        flat = sum(len(c.token_ids) for c in order)
        # Vectorized slot mapping: token k of chunk j sits at block_table[j][pos // L] · L + pos % L.
        tables = [c.seq.block_table for c in order]
        max_blocks = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)  # (C, blocks)
        lens = torch.tensor([len(c.token_ids) for c in order])
        starts = torch.tensor([c.start for c in order])
        chunk_of_token = torch.repeat_interleave(torch.arange(len(order)), lens)  # (T,)
        offsets = torch.arange(flat) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        pos = starts[chunk_of_token] + offsets  # (T,)
        slots = table[chunk_of_token, pos // bs] * bs + pos % bs
        num_decodes = sum(c.decode for c in order)
        nd = sum(len(c.token_ids) for c in order[:num_decodes])  # decode rows
        decode_tables = decode_mask = None
        if nd:
            width = -(-(int(pos[:nd].max()) + 1) // bs)
            decode_tables = table[chunk_of_token[:nd], :width]  # (Nd, width)
            decode_mask = decode_key_mask(pos[:nd], width * bs)
        prefill_tables = [table[num_decodes + i, :-(-(c.start + len(c.token_ids)) // bs)]
                          for i, c in enumerate(order[num_decodes:])]
        return pos, slots, decode_tables, decode_mask, prefill_tables

    def _clear_lora(self) -> None:
        if self.lora is not None:
            self.lora.clear_step()

    def _set_lora(self, metadata: AttentionMetadata, seqs: list[Sequence], lens: list[int], nd: int) -> None:
        """Tell the LoRA hooks and the caches which adapter each flat token uses (seqs, lens in flat order;
        the first nd tokens are decode rows)."""
        if self.lora is None:
            return
        self.lora.set_step([s.lora for s in seqs], lens, self.device)
        if self.lora.token_adapter is not None:
            metadata.lora = self.lora
            metadata.decode_adapter = self.lora.token_adapter[:nd]
            starts = torch.tensor([0] + lens).cumsum(0)
            metadata.prefill_adapters = [int(self.lora.token_adapter[starts[i]]) for i in range(len(seqs))
                                         if starts[i] >= nd]

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> tuple[torch.Tensor, list[int]]:
        """The main model over `chunks` → hidden before the final norm (T, H), first row per chunk."""
        hidden, rows, _ = self._forward(chunks)
        return hidden, rows

    def _forward(self, chunks: list[Chunk]) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """forward, and the fp32 logits of every row (T, V) where a compiled step computed them (else None: a
        speculative verify, which takes the hidden states alone, leaves a compiled step's logits unused)."""
        ids, positions, metadata, rows = self.prepare(chunks, dense=True)
        if self.compiled is not None and self.compiled.applies(ids, metadata):
            hidden, logits = self.compiled(ids, positions, metadata)  # our kernels: no matmul switch to set
            return hidden, rows, logits
        for cache in self.caches:
            cache.metadata = metadata
        try:
            with self._kernels(ids.shape[1]):
                hidden, _, _ = self.model.hidden(ids, positions=positions, kv_caches=self.caches)  # (1, T, H)
        finally:
            self._clear_lora()
        return hidden[0], rows, None

    @torch.inference_mode()
    def forward_mtp(self, depth: int, chunks: list[Chunk],
                    h_prev: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """MTP module `depth` (0-based) over `chunks`, whose token ids are the *next* tokens (position t
        carries token t+1); h_prev: per chunk the previous depth's hidden (len, H) → this module's
        hidden before its norm (T, H), and the first flat row per chunk."""
        ids, positions, metadata, rows = self.prepare(chunks)
        cache = self.mtp_caches[depth]
        cache.metadata = metadata
        model = self.model
        flat = h_prev[0].new_empty(ids.shape[1], h_prev[0].shape[-1])  # (T, H) in prepare's layout
        for h, r in zip(h_prev, rows, strict=True):
            flat[r:r + h.shape[0]] = h
        cos, sin = model.rotary(positions)
        self._clear_lora()  # the MTP modules take no LoRA
        h = model.mtp[depth](flat[None], model.embed_tokens(ids), cos, sin, kv_cache=cache)  # (1, T, H)
        return h[0], rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """One plain step → logits (N, V) fp32 for the N sequences that sample, those sequences, and for
        each sequence wanting prompt logprobs the fp32 logits (R, V) of the rows that predict its next R
        prompt tokens (the first is its token number len(seq.prompt_logprobs))."""
        chunks = chunks_of(batch)
        rows = first_rows(chunks)
        prompt = prompt_rows(chunks, rows)
        sample = [(r + len(c.token_ids) - 1, c.seq) for c, r in zip(chunks, rows, strict=True)
                  if c.start + len(c.token_ids) == c.seq.num_tokens]
        # only these rows reach the head, in one call: prompt-logprob rows, then the sampled rows
        head_rows = [i for _, span in prompt for i in range(span.start, span.stop)] + [r for r, _ in sample]
        logits = self.execute(chunks, head_rows)
        prompt_logits, start = [], 0
        for seq, span in prompt:
            prompt_logits.append((seq, logits[start:start + span.stop - span.start]))
            start += span.stop - span.start
        return logits[start:] if start else logits, [s for _, s in sample], prompt_logits

    def execute(self, chunks: list[Chunk], head_rows: list[int]) -> torch.Tensor:
        """The main model over `chunks`, then the head on flat rows `head_rows` → fp32 logits (R, V).
        The seam serve/sharded_runner.py's ShardedRunner mirrors on the other ranks of a TP group. A plain decode
        step may replay a CUDA graph (serve/graphs.py): its logits are then valid until the next step."""
        if self.graphs is not None and self.graphs.applies(chunks) and head_rows == list(range(len(chunks))):
            self.dense_rows.invalidate()  # (CPU tests of the GPU path) the graph writes the pools only
            return self.graphs(chunks)
        hidden, _, logits = self._forward(chunks)
        if logits is not None and head_rows == list(range(logits.shape[0])):  # a plain decode step: every row
            return logits
        if not head_rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size).float()
        with self._kernels(hidden.shape[0]):
            return self.logits(hidden[head_rows])

    def _kernels(self, num_tokens: int):
        """The matmul kernels for a step of `num_tokens` (see one_row_native)."""
        return onednn(False) if num_tokens == 1 and self.one_row_native else contextlib.nullcontext()

    @torch.inference_mode()
    def decode_steps(self, seqs: list[Sequence], num_steps: int, draw) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Multi-step decoding: `num_steps` decode steps for `seqs` (each with only its last token not yet
        computed, and blocks for num_steps tokens from there), sampling on the model side: each step's
        ids (B,) = draw(logits (B, V)) feed the next step as tensors, and the metadata advances by
        tensor ops, so no per-sequence Python runs between steps. → per step (ids (B,), logits (B, V)).
        With compiled steps or CUDA graphs each step is a plain step's `execute` instead (the compiled program, whose
        dense rows carry over from step to step; the graph): the eager model over the pool would cost more than the
        Python it saves."""
        if self.compiled is not None or self.graphs is not None:
            return self._executed_steps(seqs, num_steps, draw)
        bs, to, b = self.block_size, self.device, len(seqs)
        self.dense_rows.invalidate()  # these steps write the pool only
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], device=to)  # (B, W)
        pos = torch.tensor([s.num_tokens - 1 for s in seqs], device=to)  # (B,) position of the token computed
        ids = torch.tensor([s.token_ids[-1] for s in seqs], device=to)
        rows, key_pos = torch.arange(b, device=to), torch.arange(width * bs, device=to)
        steps = []
        for _ in range(num_steps):
            metadata = AttentionMetadata(
                slot_mapping=tables[rows, pos // bs] * bs + pos % bs, num_decodes=b, decode_block_tables=tables,
                decode_mask=(key_pos < pos[:, None] + 1)[:, None, None, :],  # (B, 1, 1, W·L)
                prefill_block_tables=[], prefill_query_lens=[], prefill_context_lens=[], prefill_masks=[])
            self._set_lora(metadata, seqs, [1] * b, b)
            for cache in self.caches:
                cache.metadata = metadata
            try:
                with self._kernels(b):
                    hidden, _, _ = self.model.hidden(ids[None], positions=pos, kv_caches=self.caches)  # (1, B, H)
                    logits = self.logits(hidden[0])
            finally:
                self._clear_lora()
            ids = draw(logits)
            steps.append((ids, logits))
            pos = pos + 1
        return steps

    def _executed_steps(self, seqs: list[Sequence], num_steps: int, draw) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """decode_steps as `num_steps` plain decode steps, each sampled token the next step's input."""
        tokens, rows, steps = [s.token_ids[-1] for s in seqs], list(range(len(seqs))), []
        for k in range(num_steps):
            chunks = [Chunk(s, s.num_tokens - 1 + k, [t], decode=True) for s, t in zip(seqs, tokens, strict=True)]
            logits = self.execute(chunks, rows)
            if self.graphs is not None:  # a graph's logits are its static output, which the next step rewrites
                logits = logits.clone()
            ids = draw(logits)
            steps.append((ids, logits))
            tokens = ids.tolist()
        return steps

    def logits(self, hidden: torch.Tensor, norm=None) -> torch.Tensor:
        """hidden (N, H) before a norm (default the main model's) → fp32 logits (N, V)."""
        model = self.model
        return model.lm_head((norm or model.norm)(hidden)).float()
