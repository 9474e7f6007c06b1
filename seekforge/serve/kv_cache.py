"""Paged latent KV cache for MLA and the per-step attention metadata.

Shape legend: P num_blocks, L block_size, r kv_lora_rank, dr qk_rope_head_dim, nh heads,
T tokens in the step (all sequences, flattened), Nd decode rows, Sd = the widest decode context in blocks · L.

Each layer's pool stores only what MLA needs to rebuild keys and values: the normed latent c_kv
(r values) and the rotated shared key k_pe (dr values) per token — (r + dr) instead of nh·(dqk + dv).
With `int8` (EngineConfig.kv_cache_dtype="int8") each token's c_kv and k_pe are stored as int8 with
one fp32 absmax scale each (symmetric, per token, as activations are quantized in quant/schemes.py)
and dequantized to the model's dtype when gathered; both attention paths then run unchanged.

A step is one flat batch (B = 1, T tokens) laid out as [decode rows | prefill chunk 1 | chunk 2 …]
(the runner orders it so). A decode row is one query token with its own block table and context
length: a plain decode is one row; a speculative verify of 1 + k tokens is 1 + k rows of one sequence
with context lengths n+1 … n+k+1 (causal among them), so it too runs the absorbed path.
`AttentionMetadata` plays the role of nano-vllm's Context: the slot of every token, and per decode
row / prefill chunk its block table and query/context lengths. Every layer's
`PagedLatentCache.attend` (called from `MLA.forward`) writes this step's latents to their slots, then
  decodes  — one batched absorbed-MLA call over the gathered latents, padding masked out;
  prefills — one naive-MLA call per chunk, causal over (cached context + chunk); adjacent first chunks of
             prompts (nothing cached before them) as one call over a batch of documents (`fresh_runs`).
             Both on PyTorch's fused attention kernel (`MLA.attend_naive(fused=True)`).

Dense decode rows (`DenseRows`): gathering every decode row's blocks copies the whole decode context of every
layer each step, which took as long as the attention over it (then two batched matmuls). While the same
sequences decode step after step (plain one-token decodes), each layer instead keeps their latents in a dense
(rows, capacity, r + dr) tensor, gathered from the pool once on the second step of the same decoding set (on
its first where the steps run compiled: serve/compiled.py), appended to in place every step after, and
attention reads it as a view. The pool is written as always (it stays the source of truth: prefix caching,
preemption, spec decode and multi-step read it).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from seekforge.config import ModelConfig
from seekforge.model import kernels
from seekforge.model.model import SCORES_CHUNK_BYTES, DocumentLayout
from seekforge.model.precision import onednn, onednn_size
from seekforge.quant.schemes import quantize_activation


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: block · L + offset, where each token's latents go
    num_decodes: int  # the first num_decodes tokens are decode rows
    decode_block_tables: torch.Tensor | None  # (Nd, max blocks) int64, padded with block 0
    decode_mask: torch.Tensor | None  # (Nd, 1, 1, Sd) bool, True = a real context token
    prefill_block_tables: list[torch.Tensor]  # per chunk: (blocks,) int64
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]  # cached tokens before the chunk + the chunk
    prefill_masks: list[torch.Tensor]  # per chunk: (q_len, context_len) bool, causal after the cached part
    # Multi-LoRA (lora.py): the manager, and per decode row / prefill chunk its adapter slot (-1 = base)
    lora: object | None = None
    decode_adapter: torch.Tensor | None = None  # (Nd,) int64
    prefill_adapters: list[int] | None = None
    dense: DenseStep | None = None  # decode rows read the dense rows (see DenseRows) instead of a gather
    # first chunk of a run of fresh prompt chunks → (chunks in the run, their DocumentLayout): see fresh_runs
    prefill_runs: dict[int, tuple[int, DocumentLayout]] | None = None


@dataclass
class DenseStep:
    """A step whose decode rows are the dense rows 0 … Nd-1 (see DenseRows)."""

    rebuild: bool  # True: refill the dense rows from the pool (PagedLatentCache.build_dense)
    rows: int  # rows to allocate when the tensor is too small (≥ Nd: room for a growing batch)
    capacity: int  # tokens per dense row
    context_len: int  # the longest decode context this step (rows are read up to it; shorter ones masked)
    write_index: torch.Tensor  # (Nd,) int64 row · capacity + position: where this step's latents go
    uniform: bool = False  # every row's context is context_len: nothing to mask (batch 1 always)


def fresh_runs(query_lens: list[int], starts: list[int], num_heads: int,
               device) -> dict[int, tuple[int, DocumentLayout]]:
    """Prefill chunks (their query lengths and first positions, in flat order) → the runs of two or more
    adjacent fresh ones (a prompt's first chunk: no cached context) to attend as one batch of documents.
    One chunk at a time costs some 20 small ops per chunk and layer, which a batch of many short prompts
    (serve_throughput.py's 64 requests) pays visibly. A run grows while the
    padding to its longest prompt keeps the padded (D, L, L) scores within 2x of the chunks' own and within
    SCORES_CHUNK_BYTES."""
    runs, i, n = {}, 0, len(query_lens)
    while i < n:
        j, longest, own = i, 0, 0
        while j < n and starts[j] == 0:
            size = max(longest, query_lens[j])
            padded = (j - i + 1) * onednn_size(size) ** 2
            if j > i and (padded > 2 * (own + query_lens[j] ** 2) or 4 * num_heads * padded > SCORES_CHUNK_BYTES):
                break
            longest, own, j = size, own + query_lens[j] ** 2, j + 1
        if j - i >= 2:
            segments = torch.repeat_interleave(torch.arange(j - i), torch.tensor(query_lens[i:j]))
            runs[i] = (j - i, DocumentLayout(segments[None].to(device), onednn_size))
        i = max(j, i + 1)
    return runs


def plain_decode_rows(order: list, block_size: int, rows: int | None = None, pad_block: int = 0
                      ) -> tuple[list[int], int]:
    """The inputs of a step whose chunks (runner.Chunk, in flat order) are all one-token decodes, as one flat list
    of Python ints: input ids, positions, slots (each `rows` long), then the block tables (rows × width, width =
    the blocks of the longest context). `rows` (default len(order)): the rows past the chunks are padding rows
    (serve/graphs.py), token 0 at position 0 of block `pad_block`, which also fills the tables past each row's
    blocks. → (flat, width)."""
    b, pos = len(order), [c.start for c in order]
    pad = (rows or b) - b
    width = -(-(max(pos, default=0) + 1) // block_size)
    flat = [c.token_ids[0] for c in order]
    if pad:
        flat += [0] * pad
    flat += pos
    if pad:
        flat += [0] * pad
    flat += [c.seq.block_table[p // block_size] * block_size + p % block_size for c, p in zip(order, pos, strict=True)]
    if pad:
        flat += [pad_block * block_size] * pad
    for c in order:
        table = c.seq.block_table[:width]
        flat += table + [pad_block] * (width - len(table))
    if pad:
        flat += [pad_block] * (pad * width)
    return flat, width


def mask_width(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A key mask (..., S) cut, or extended with False, to (..., width)."""
    if mask.shape[-1] >= width:
        return mask[..., :width]
    return torch.cat([mask, mask.new_zeros(*mask.shape[:-1], width - mask.shape[-1])], dim=-1)


class DenseRows:
    """Which sequence owns which dense decode row (the same in every layer), and when the rows are built
    from the pool. A step's plain decode rows use them once the previous step decoded exactly the same
    sequences, in the same order, one token each (the first such step builds them, the ones after append
    to them): in an eager step a build costs about two gathers, so a decoding set that changes every step
    (arrivals, finishes) keeps to the gather instead of paying a build each step. `at_once`: a new set's
    rows are built on its first step, for steps that run compiled (serve/compiled.py), where a build and a
    compiled step cost far less than one eager step. Anything else between two plans (a prefill-only step, a
    speculative verify, multi-step decoding: `invalidate`) starts over, so a dense row never holds a latent
    the pool does not (a preempted sequence's recomputed latents included)."""

    def __init__(self, budget_bytes: int, bytes_per_token: int, at_once: bool = False):
        self.budget_bytes = budget_bytes  # all layers' dense rows together (the runner: its pools' bytes)
        self.bytes_per_token = bytes_per_token  # one token's latents, all layers
        self.at_once = at_once
        self.invalidate()

    def invalidate(self) -> None:
        self.seq_ids: list[int] = []  # the last planned step's decode rows
        self.lengths: list[int] = []  # and the tokens each has after it
        self.built = False  # do the dense rows hold them?
        self.capacity = self.rows = 0

    def plan(self, seq_ids: list[int], positions: list[int], device) -> DenseStep | None:
        """The step's decode rows (sequence ids, position of each row's token) → a DenseStep, or None when
        this step gathers (a new decoding set, unless `at_once`; rows over the budget)."""
        context_len = max(positions) + 1
        uniform = min(positions) + 1 == context_len
        continues = seq_ids == self.seq_ids and positions == self.lengths
        self.seq_ids, self.lengths = list(seq_ids), [p + 1 for p in positions]
        if continues and self.built and context_len <= self.capacity:
            return DenseStep(rebuild=False, rows=self.rows, capacity=self.capacity, context_len=context_len,
                             write_index=write_index(self.capacity, positions, device), uniform=uniform)
        self.built = False
        if not (continues or self.at_once):
            return None
        # headroom of 128 tokens: growing the capacity costs a rebuild (one gather)
        capacity = max(self.capacity, -(-(context_len + 128) // 128) * 128)
        if len(seq_ids) * capacity * self.bytes_per_token > self.budget_bytes:
            return None
        # rows to allocate: a power of two, so that a ramping batch reallocates log2(B) times
        fit = self.budget_bytes // (capacity * self.bytes_per_token)
        self.rows = max(len(seq_ids), min(1 << (len(seq_ids) - 1).bit_length(), fit))
        self.capacity, self.built = capacity, True
        return DenseStep(rebuild=True, rows=self.rows, capacity=capacity, context_len=context_len,
                         write_index=write_index(capacity, positions, device), uniform=uniform)


def write_index(capacity: int, positions: list[int], device) -> torch.Tensor:
    """Each decode row's token (row i at positions[i]) → its place in the flattened dense rows (Nd,)."""
    return torch.tensor([row * capacity + p for row, p in enumerate(positions)], device=device)


class GatherScratch:
    """Reusable outputs for the gathers of one step, shared by every layer (they run one after the
    other, and each consumes its gathered latents before the next layer gathers).

    A fresh tensor per gather costs more than the copy into it once it is large: glibc serves
    allocations over 32 MiB with a fresh mmap, whose pages fault in on first touch: a large decode
    gather into a new tensor took several times as long as into a reused one. The buffers only grow;
    `clear` frees them (GRPO frees the pool between rollouts)."""

    def __init__(self, dense_rows: DenseRows | None = None):
        self.buffers: dict[str, torch.Tensor] = {}
        self.dense_rows = dense_rows  # the runner's; `clear` frees the dense tensors, so it resets these

    def take(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A 1-D tensor of `numel` elements, valid until the next take(name)."""
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self.buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def clear(self) -> None:
        self.buffers.clear()
        if self.dense_rows is not None:
            self.dense_rows.invalidate()


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape), on a CPU backed by an anonymous memory map: the kernel supplies zero pages as they
    are first touched, so a pool is allocated in microseconds and holds memory only for the blocks in use.
    torch.zeros writes every page: the default 512 MiB pool took a noticeable pause (every GRPO rollout after
    the swap allocates it again) and counted 512 MiB of RSS however little of it a run used. The tensor keeps
    the map alive; the pages go back to the system with it."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # (Windows)
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE)  # private: a fork copies on write
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * torch.tensor([], dtype=dtype).element_size()
    if dtype == torch.int8:
        per_token += 2 * 4  # the fp32 scales of c_kv and k_pe
    return per_token * block_size * cfg.num_hidden_layers


class PagedLatentCache:
    """One layer's block pool. `metadata` is shared by all layers and replaced every step."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype, device,
                 kv_b_name: str | None = None, int8: bool = False, scratch: GatherScratch | None = None,
                 layer: int = 0):
        self.scratch = scratch or GatherScratch()
        self.layer = layer  # names this layer's dense rows in the scratch
        self.kv_b_name = kv_b_name  # this layer's kv_b_proj, which a LoRA adapter may target (lora.py)
        self.dtype = dtype  # of the latents attention reads
        store = torch.int8 if int8 else dtype
        self.c_kv = zeros_on_demand((num_blocks, block_size, cfg.kv_lora_rank), store, device)
        self.k_pe = zeros_on_demand((num_blocks, block_size, cfg.qk_rope_head_dim), store, device)
        # int8: one scale per cached token for each of c_kv and k_pe, (P, L, 1) fp32
        self.c_kv_scale = torch.ones(num_blocks, block_size, 1, device=device) if int8 else None
        self.k_pe_scale = torch.ones(num_blocks, block_size, 1, device=device) if int8 else None
        self.metadata: AttentionMetadata | None = None
        if torch.device(device).type == "cpu":
            kernels.load()  # our decode kernels, where this CPU wants them (built once per machine)

    def attend(self, attn, q_nope, q_pe, c_kv, k_pe):
        """q_nope (1, T, nh, dn), q_pe (1, T, nh, dr), c_kv (1, T, r), k_pe (1, T, dr) → (1, T, nh·dv).
        Always on oneDNN, which reads the cached latents fastest (precision.onednn), whatever kernels the
        step's linear layers run on."""
        with onednn(True):
            return self._attend(attn, q_nope, q_pe, c_kv, k_pe)

    def _attend(self, attn, q_nope, q_pe, c_kv, k_pe):
        md = self.metadata
        r, dr = self.c_kv.shape[-1], self.k_pe.shape[-1]
        self._write(self.c_kv, self.c_kv_scale, md.slot_mapping, c_kv[0])
        self._write(self.k_pe, self.k_pe_scale, md.slot_mapping, k_pe[0])
        outs = []
        nd = md.num_decodes
        if nd:
            latents = None
            if md.dense is not None:
                latents = self._dense(md, nd, c_kv[0, :nd], k_pe[0, :nd])  # (Nd, Sd, r + dr)
                ctx_c_kv, ctx_k_pe = latents[..., :r], latents[..., r:]
                # rows of one length read no padding: no mask (the fused attention's masking is not free)
                mask = None if md.dense.uniform else mask_width(md.decode_mask, latents.shape[1])
            else:
                tables = md.decode_block_tables
                ctx_c_kv = self._read("c_kv", tables.flatten()).view(nd, -1, r)  # (Nd, Sd, r)
                ctx_k_pe = self._read("k_pe", tables.flatten()).view(nd, -1, dr)  # (Nd, Sd, dr)
                mask = md.decode_mask
            out = attn.attend_absorbed(q_nope[0, :nd, None], q_pe[0, :nd, None], ctx_c_kv, ctx_k_pe,
                                       mask=mask, latents=latents)  # (Nd, 1, nh·dv)
            if md.decode_adapter is not None and self.kv_b_name is not None:
                # rows of adapters with a LoRA on kv_b_proj: absorbed again with the merged weight
                for rows, weight in md.lora.kv_b_groups(attn.kv_b_proj, self.kv_b_name, md.decode_adapter):
                    out[rows] = attn.attend_absorbed(q_nope[0, rows, None], q_pe[0, rows, None], ctx_c_kv[rows],
                                                     ctx_k_pe[rows], mask=None if mask is None else mask[rows],
                                                     kv_b_weight=weight)
            outs.append(out[:, 0])
        # a run of fresh prompts attends from this step's own latents, as one batch of documents: the int8
        # pool's rounded latents, or a LoRA's kv_b_proj per prompt, take the per-chunk path
        lora_kv_b = md.prefill_adapters is not None and self.kv_b_name is not None
        runs = md.prefill_runs if md.prefill_runs and self.c_kv_scale is None and not lora_kv_b else {}
        i, start = 0, nd
        while i < len(md.prefill_query_lens):
            count, layout = runs.get(i, (1, None))
            end = start + sum(md.prefill_query_lens[i:i + count])
            rows = slice(start, end)
            if layout is not None:
                out = attn.attend_naive(q_nope[:, rows], q_pe[:, rows], c_kv[:, rows], k_pe[:, rows], mask=layout,
                                        fused=True)
            else:
                table, ctx_len = md.prefill_block_tables[i], md.prefill_context_lens[i]
                ctx_c_kv = self._read("c_kv", table).view(-1, r)[None, :ctx_len]  # (1, S, r)
                ctx_k_pe = self._read("k_pe", table).view(-1, dr)[None, :ctx_len]
                weight = None
                if lora_kv_b:
                    weight = md.lora.merged_kv_b(attn.kv_b_proj, self.kv_b_name, md.prefill_adapters[i])
                out = attn.attend_naive(q_nope[:, rows], q_pe[:, rows], ctx_c_kv, ctx_k_pe, mask=md.prefill_masks[i],
                                        kv_b_weight=weight, fused=True)
            outs.append(out[0])
            i, start = i + count, end
        return torch.cat(outs)[None] if len(outs) > 1 else outs[0][None]

    def _dense(self, md: AttentionMetadata, nd: int, c_kv: torch.Tensor, k_pe: torch.Tensor):
        """This layer's dense decode rows (see DenseRows) after this step: c_kv (Nd, r), k_pe (Nd, dr) are
        the step's latents → a view (Nd, Sd, r + dr) of the rows ([c_kv | k_pe]), row stride capacity·(r + dr)."""
        step = md.dense
        if step.rebuild:
            dense = self.build_dense(md)  # the pool already holds this step's latents
        else:
            dense = self.scratch.buffers[f"dense{self.layer}"]
            latents = torch.cat([self._as_stored(c_kv, self.c_kv_scale), self._as_stored(k_pe, self.k_pe_scale)], -1)
            dense.view(-1, dense.shape[-1]).index_copy_(0, step.write_index, latents)
        return dense[:nd, :step.context_len]

    def build_dense(self, md: AttentionMetadata) -> torch.Tensor:
        """Fill this layer's dense decode rows 0 … Nd-1 (a `rebuild` step, md.dense) from each row's blocks of
        the pool, zeros past them → the (rows, capacity, r + dr) tensor. A compiled step builds them before it
        runs, so the slot of its own token holds what the pool held there until the step writes it."""
        step, nd, r = md.dense, md.num_decodes, self.c_kv.shape[-1]
        width = r + self.k_pe.shape[-1]
        name = f"dense{self.layer}"
        dense = self.scratch.buffers.get(name)
        if dense is None or dense.shape[0] < nd or dense.shape[1] != step.capacity:
            dense = self.scratch.buffers[name] = torch.empty(step.rows, step.capacity, width, dtype=self.dtype,
                                                             device=self.c_kv.device)
        tables = md.decode_block_tables.flatten()
        filled = min(step.capacity, md.decode_block_tables.shape[1] * self.c_kv.shape[1])
        dense[:nd, :filled, :r] = self._read("c_kv", tables).view(nd, -1, r)[:, :filled]
        dense[:nd, :filled, r:] = self._read("k_pe", tables).view(nd, -1, width - r)[:, :filled]
        # a shorter row's masked tail is read too: finite values there (probability 0 × NaN is NaN)
        dense[:nd, filled:].zero_()
        return dense

    def _as_stored(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """x (T, ·) as a read of the pool returns it: int8 pools round it through int8 (as _read does)."""
        if scale is None:
            return x
        x, token_scale = quantize_activation(x)  # (T, ·) int8, (T, 1) fp32
        return (x.float() * token_scale).to(self.dtype)

    @staticmethod
    def _write(pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x (T, ·) → its slots of a (P, L, ·) pool; int8 pools also take each token's scale."""
        if scale is not None:
            x, token_scale = quantize_activation(x)  # (T, ·) int8, (T, 1) fp32
            scale.view(-1, 1).index_copy_(0, slots, token_scale)
        pool.view(-1, pool.shape[-1]).index_copy_(0, slots, x)

    def _read(self, name: str, blocks: torch.Tensor) -> torch.Tensor:
        """Whole blocks of pool `name` ("c_kv" | "k_pe") → (len(blocks), L·(·)) in the attention dtype,
        dequantized when int8; a view of the step's scratch (see GatherScratch)."""
        pool, scale = getattr(self, name), getattr(self, f"{name}_scale")
        data = self._gather(pool, blocks, name)
        if scale is None:
            return data
        n, width = data.shape[0], pool.shape[-1]
        token_scale = self._gather(scale, blocks, f"{name}_scale")  # (n, L)
        return (data.view(n, -1, width).float() * token_scale[..., None]).to(self.dtype).view(n, -1)

    def _gather(self, pool: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
        """Whole blocks of a (P, L, ·) pool → (len(blocks), L·(·)). index_select copies rows with memcpy;
        advanced indexing (pool[blocks]) measured several times slower on CPU."""
        rows = pool.view(pool.shape[0], -1)
        out = self.scratch.take(name, len(blocks) * rows.shape[1], pool.dtype, pool.device)
        return torch.index_select(rows, 0, blocks, out=out.view(len(blocks), rows.shape[1]))
