"""Plain decode steps as CUDA graphs (the GPU path; `EngineConfig.cuda_graphs`, `seekforge serve --no-cuda-graphs`).

An eager decode step launches hundreds of small kernels, one Python op each: at small batches the GPU sits idle
most of the step waiting for the CPU to issue them. vLLM and SGLang capture the step once per batch size as a CUDA
graph and replay it: one launch for the whole model. `GraphedDecode` does that for seekforge's engine.

Shape legend: B real rows (sequences decoding this step), Bp the capture size they are padded to, Bmax the
largest capture size, Wmax the blocks of the longest sequence (max_model_len / block_size), L block_size,
P pool blocks, r kv_lora_rank, dr qk_rope_head_dim, nh heads, V vocab.

A graph replays fixed kernels on fixed addresses, so everything a step reads or writes lives in static buffers
made once, at engine start, and captured with the graph:

  inputs   (3·Bmax + Bmax·Wmax,) int64: for capture size Bp its first 3·Bp entries are the step's token ids,
           positions and slots (each Bp long); the next Bp·W stage the block tables (W = this step's width)
  tables   (Bmax, Wmax) int64: the block tables the graphs read (graph Bp reads rows :Bp)
  logits   (Bmax, V) fp32: the graphs' output (graph Bp writes rows :Bp)
  the pools (serve/kv_cache.PagedLatentCache's c_kv (P, L, r) and k_pe (P, L, dr) of every layer)

A step of B rows (`__call__`) builds its inputs padded to Bp on the host (one flat list: kv_cache.plain_decode_rows),
copies them in one host→device copy (from pinned memory, non_blocking: no wait on the GPU), spreads the tables
into `tables[:Bp, :W]` (one device copy), replays graph Bp, and returns `logits[:B]`, a view valid until the next
step. The captured step (`GraphedDecode._step`): embed → every block, whose attention is `GraphCache.attend`:
the step's latents index_copy_'d into the pools at `slots`, then absorbed MLA over the paged cache by the
`mla_decode` kernel (context length = position + 1, computed in the graph) → final norm → lm_head → fp32 logits.
MoE layers take `fused_moe` on the GPU path (model/moe.py; where a layer still reads the host, as the CPU's routes
do, capturing fails and the engine decodes eagerly, with a warning). Sampling runs eagerly after the replay on the
logits on the device (serve/sampling.py, sync-free for greedy and temperature / top-k / top-p / min-p rows); the
engine reads the sampled ids with one `.tolist()`: the one device→host copy, and the only wait, of a step.

Padding rows (B < Bp) are harmless by construction: each is token 0 at position 0 of a scratch block, one block
allocated past the block manager's (`scratch_block` = its num_blocks: the runner's pools hold num_blocks + 1
blocks when graphs are on, and no sequence is ever given that block), so its latents go to the scratch block's
first slot and it attends to that one slot (context length 1): real attention over real numbers, whatever the
kernel does with empty rows. Every entry of `tables` is always a valid block id (the scratch block initially, a
real row's table entries, or the scratch block past them), so the stale rows and columns a larger earlier step
left behind are never out of range, and no row reads past its own context length.

Capture (`capture`, at engine start): the sizes 1, 2, 4, 8, 16, 24, 32, … (steps of 8) up to the largest,
min(max_cuda_graph_batch, max_num_seqs) (always captured), largest first into one shared memory pool (the smaller
graphs reuse the larger one's memory), each after warm-up steps on a side stream (torch.cuda.graphs' recipe:
lazy initialization, cuBLAS workspaces and Triton's compilation happen outside the capture). The warm-up and
capture steps are all-padding steps: they write the scratch block only. Off CUDA (tests inside
forced_gpu_path on CPU) `EagerGraph` stands in for the CUDA graph: it records the step and calls it again on every
replay, on the same static buffers, so the tests check the buffer plumbing (padding, stale rows of a larger
earlier batch, the inputs of each step, the pools bound at capture) exactly as a graph sees it. If the pools are
allocated anew (a GRPO rollout's sleep / wake_up), the graphs are captured again before the next step. The weights
are read at their addresses too: they may change in place (GRPO's replica copies into its tensors), not be
replaced.

Which steps replay a graph: plain decode steps (every chunk one decode token) of at most Bmax sequences, with no
prompt-logprob rows. Eager, as before: prefill and chunked-prefill steps, mixed steps, larger batches, and
(for the whole engine, `supports`) speculative decoding, LoRA, int8 latents, quantized or sharded weights and
serving across ranks.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time

import torch

from seekforge.model.gpu.mla_decode import mla_decode
from seekforge.serve.compiled import CompiledDecode
from seekforge.serve.kv_cache import PagedLatentCache, plain_decode_rows

log = logging.getLogger("seekforge.serve")

WARMUP_STEPS = 2  # eager steps on the side stream before each capture


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture, vLLM's: 1, 2, 4, 8, then every multiple of 8, up to and including max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class GraphCache:
    """MLA's kv_cache inside a graphed decode step of Bp rows: row i's latents go to slots[i] of the layer's
    pools; it attends to the first context_lens[i] tokens of its block table (block_tables[i]) with mla_decode."""

    def __init__(self, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor):
        self.c_kv, self.k_pe = c_kv, k_pe  # (P, L, r), (P, L, dr)
        self.slots, self.block_tables, self.context_lens = slots, block_tables, context_lens  # (Bp,), (Bp, W), (Bp,)

    def attend(self, attn, q_nope, q_pe, c_kv, k_pe):
        """q_nope (1, Bp, nh, dn), q_pe (1, Bp, nh, dr), c_kv (1, Bp, r), k_pe (1, Bp, dr) → (1, Bp, nh·dv).
        The absorbed form (MLA.attend_absorbed at one query token): q_latent = q_nope · w_uk per head, attention
        over the cached latents, the output back through w_uv."""
        r, dr = c_kv.shape[-1], k_pe.shape[-1]
        self.c_kv.view(-1, r).index_copy_(0, self.slots, c_kv[0])
        self.k_pe.view(-1, dr).index_copy_(0, self.slots, k_pe[0])
        w_uk, w_uv = attn.kv_b_weights()  # (nh, dn, r), (nh, dv, r)
        q_latent = torch.bmm(q_nope[0].transpose(0, 1), w_uk)  # (nh, Bp, r)
        out = mla_decode(q_latent.transpose(0, 1).contiguous(), q_pe[0], self.c_kv, self.k_pe, self.block_tables,
                         self.context_lens, attn.softmax_scale)  # (Bp, nh, r)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # (nh, Bp, dv)
        return out.transpose(0, 1).reshape(1, out.shape[1], -1)


class CudaGraph:
    """torch.cuda.CUDAGraph, captured as torch's docs say: warm-up steps on a side stream first."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, step, pool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=pool):
            step()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """Stands in for a CUDA graph off CUDA (tests, inside forced_gpu_path): `capture` runs the step once and
    keeps it; `replay` runs it again, eagerly, on the same static buffers."""

    def capture(self, step, pool) -> None:
        step()
        self.step = step

    def replay(self) -> None:
        self.step()


class GraphedDecode:
    """The captured decode steps over a runner's pools (see the module docstring)."""

    def __init__(self, model, caches: list[PagedLatentCache], scratch_block: int, block_size: int,
                 max_model_len: int, max_batch: int):
        self.model, self.caches = model, caches
        self.scratch_block, self.block_size = scratch_block, block_size
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        device = caches[0].c_kv.device
        self.on_cuda = device.type == "cuda"
        width = -(-max_model_len // block_size)  # Wmax
        self.inputs = torch.zeros(3 * max_batch + max_batch * width, dtype=torch.long, device=device)
        self.tables = torch.full((max_batch, width), scratch_block, dtype=torch.long, device=device)
        self.logits = torch.zeros(max_batch, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, CudaGraph | EagerGraph] = {}
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = []  # the pools the graphs were captured on

    @staticmethod
    def supports(model, config) -> str | None:
        """Why this model and engine config cannot replay graphed decode steps, or None when they can: what a
        compiled step cannot take either (int8 latents, LoRA, quantized or sharded weights), and more."""
        why_not = CompiledDecode.supports(model, config)
        if why_not:
            return why_not
        if config.speculative_tokens:
            return "speculative decoding verifies its drafts eagerly"
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            return "serving across ranks decodes eagerly (collectives are not captured)"
        return None

    def applies(self, chunks: list) -> bool:
        """Is this step plain decodes (every chunk one decode token) of at most max_batch sequences?"""
        return len(chunks) <= self.max_batch and all(c.decode and len(c.token_ids) == 1 for c in chunks)

    def __call__(self, chunks: list) -> torch.Tensor:
        """A plain decode step of B = len(chunks) rows (runner.Chunk, in flat order) → fp32 logits (B, V): a view of
        the static output, valid until the next step. The pools take the step's latents."""
        b = len(chunks)
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        if any(c.c_kv is not c_kv or c.k_pe is not k_pe for c, (c_kv, k_pe) in zip(self.caches, self.pools,
                                                                                   strict=True)):
            log.info("the KV pools were allocated anew: capturing the decode graphs again")
            self.capture()
        self._load(size, *plain_decode_rows(chunks, self.block_size, size, self.scratch_block))
        self.graphs[size].replay()
        return self.logits[:b]

    def _load(self, size: int, flat: list[int], width: int) -> None:
        """One step's inputs (kv_cache.plain_decode_rows' flat list for `size` rows, tables `width` wide) into the
        static buffers: one host→device copy, from pinned memory on CUDA (a copy from pageable memory waits for
        the stream), then the tables into place."""
        host = torch.tensor(flat, dtype=torch.long, pin_memory=self.on_cuda)
        staged = self.inputs[:len(flat)]
        staged.copy_(host, non_blocking=True)
        self.tables[:size, :width].copy_(staged[3 * size:].view(size, width))

    def _step(self, size: int, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The captured step for `size` rows over `pools` (each layer's c_kv, k_pe, bound at capture as a graph
        binds their addresses): the static inputs → logits[:size]."""
        model, inputs = self.model, self.inputs
        ids, positions, slots = inputs[:size], inputs[size:2 * size], inputs[2 * size:3 * size]
        context_lens = positions + 1
        tables = self.tables[:size]
        caches = [GraphCache(c_kv, k_pe, slots, tables, context_lens) for c_kv, k_pe in pools]
        hidden, _, _ = model.hidden(ids[None], positions=positions, kv_caches=caches)  # (1, Bp, H)
        self.logits[:size].copy_(model.lm_head(model.norm(hidden[0])))  # the fp32 cast of Runner.logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool; each capture (and its warm-up) is an
        all-padding step, writing the scratch block only."""
        start = time.perf_counter()
        self.graphs.clear()
        pool = torch.cuda.graph_pool_handle() if self.on_cuda else None
        self.pools = [(c.c_kv, c.k_pe) for c in self.caches]
        for size in reversed(self.sizes):
            self._load(size, *plain_decode_rows([], self.block_size, size, self.scratch_block))
            graph = CudaGraph() if self.on_cuda else EagerGraph()
            graph.capture(functools.partial(self._step, size, self.pools), pool)
            self.graphs[size] = graph
        log.info("decode steps of 1 … %d sequences captured as %d %s in %.1f s; eager: prefill and chunked "
                 "prefill, mixed steps, steps with prompt logprobs, batches over %d", self.max_batch, len(self.sizes),
                 "CUDA graphs" if self.on_cuda else "stand-in graphs (no CUDA: replayed eagerly)",
                 time.perf_counter() - start, self.max_batch)

    def warm_up(self) -> bool:
        """Capture now (engine start). False, with a warning, where capturing fails: the engine then decodes
        eagerly."""
        try:
            self.capture()
        except Exception as err:  # noqa: BLE001 - any capture failure means: decode eagerly
            log.warning("CUDA graphs unavailable, decoding eagerly: %s", str(err).splitlines()[0])
            self.graphs.clear()
            return False
        return True
