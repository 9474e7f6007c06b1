"""Batch-1 decode steps as one compiled program (`EngineConfig.compile`, `seekforge serve --compile`).

A decode step of one sequence is ~500 small eager ops around ~70 one-row matmuls. On a CPU each of those
ops costs 5-25 µs once a streamed weight matrix has pushed the interpreter's and the dispatcher's working
set out of the caches, so the ops cost about as much as the matmuls. `torch.compile` (inductor) traces
the step once — the model's own modules, with the latent cache below standing in for the paged one — and
fuses the ops between the matmuls into a few generated C++ kernels, so a step runs close to the time of
reading its weights: the same role CUDA graphs play for vLLM's GPU decode. Measured on the serving
benchmarks' model (hidden 512, kv_lora_rank 512, fp32, 2 threads; BENCHMARKS.md): ~5.5 against ~9.5
ms/token, the same greedy tokens.

One program serves every context length (dynamic shapes), so it compiles once, at engine start (~30 s for
six layers on 2 cores; `warm_up`). It runs the steps that decode one sequence from the dense decode rows
(kv_cache.DenseRows): the latents it computes go to their pool slot, as always, and to the dense row,
which attention then reads. Every other step — prefill chunks, several sequences, speculative verifies,
LoRA rows, int8 latents — runs eagerly as before.
"""

from __future__ import annotations

import logging

import torch

from seekforge.serve.kv_cache import AttentionMetadata, PagedLatentCache

log = logging.getLogger("seekforge.serve")


class OneRowCache:
    """MLA's kv_cache for one decode token inside the compiled step: its latents go to `slot` of the
    layer's pools and to `dense` (1, capacity, r + dr) at position context_len - 1; attention reads the
    first context_len latents of `dense` (the fused path of MLA.attend_absorbed)."""

    def __init__(self, c_kv_pool: torch.Tensor, k_pe_pool: torch.Tensor, dense: torch.Tensor, slot: torch.Tensor,
                 context_len: int):
        self.c_kv_pool, self.k_pe_pool, self.dense = c_kv_pool, k_pe_pool, dense
        self.slot, self.context_len = slot, context_len

    def attend(self, attn, q_nope, q_pe, c_kv, k_pe):
        r, dr = c_kv.shape[-1], k_pe.shape[-1]
        self.c_kv_pool.view(-1, r).index_copy_(0, self.slot, c_kv[0])
        self.k_pe_pool.view(-1, dr).index_copy_(0, self.slot, k_pe[0])
        n = self.context_len  # (a slice: an integer index would make dynamo specialize the step on it)
        self.dense[:, n - 1:n] = torch.cat([c_kv, k_pe], dim=-1)
        latents = self.dense[:, :self.context_len]
        return attn.attend_absorbed(q_nope, q_pe, latents[..., :r], latents[..., r:], latents=latents)


def decode_one(model, ids: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, context_len: int,
               pools: list[tuple[torch.Tensor, torch.Tensor]], dense: list[torch.Tensor]) -> torch.Tensor:
    """The traced step: ids (1, 1), positions (1,), slot (1,) → hidden before the final norm (1, H)."""
    caches = [OneRowCache(c_kv, k_pe, d, slot, context_len) for (c_kv, k_pe), d in zip(pools, dense, strict=True)]
    hidden, _, _ = model.hidden(ids, positions=positions, kv_caches=caches)
    return hidden[0]


class CompiledDecode:
    """The compiled batch-1 decode step over a runner's pools and dense rows."""

    def __init__(self, model, caches: list[PagedLatentCache]):
        self.model = model
        self.caches = caches
        # dynamic: one program for every context length and dense-row capacity. fullgraph: a graph break
        # would bring back the eager ops this exists to remove, so tracing one is an error. cpp_wrapper: the
        # step's ~300 kernel calls from generated C++ rather than Python (5.6-6.8 vs 7.1-8.7 ms/token).
        # No guards: each guard check read every parameter's metadata (~0.3 ms a step), and the runner
        # calls the step only in the shapes it was traced for (`applies`), on the same modules.
        options = {"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
        self.step = torch.compile(decode_one, dynamic=True, fullgraph=True, options=options)

    @staticmethod
    def supports(model, config) -> str | None:
        """Why this model and engine config cannot run compiled steps, or None when they can."""
        if config.kv_cache_dtype != "auto":
            return "int8 latents are dequantized by the eager gather"
        if config.enable_lora:
            return "LoRA rows run eagerly"
        if any(type(p.data) is not torch.Tensor or not p.is_floating_point() for p in model.parameters()):
            return "quantized or sharded weights keep their own kernels"
        return None

    def applies(self, ids: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Is this step one sequence's plain decode from dense rows already built? Context lengths from 2 on:
        torch.compile specializes an integer that is 1, which would compile a second program."""
        step = metadata.dense
        return (ids.shape[1] == 1 and metadata.num_decodes == 1 and step is not None and not step.rebuild
                and step.context_len >= 2 and metadata.lora is None)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """→ hidden before the final norm (1, H), the pools and dense rows updated as the eager step does."""
        scratch = self.caches[0].scratch
        dense = [scratch.buffers[f"dense{c.layer}"][:1] for c in self.caches]
        return self._run(ids, positions, metadata.slot_mapping, metadata.dense.context_len, dense)

    def _run(self, ids, positions, slot, context_len, dense):
        pools = [(c.c_kv, c.k_pe) for c in self.caches]
        with torch._dynamo.config.patch(capture_scalar_outputs=True):  # the chosen experts' ids (model/moe.py)
            return self.step(self.model, ids, positions, slot, context_len, pools, dense)

    @torch.inference_mode()
    def warm_up(self) -> bool:
        """Compile now, on a scratch step (slot 0 of the pools: free at start, and a slot is always written
        before it is read). False, with a warning, where compiling fails (e.g. no C++ compiler)."""
        cache = self.caches[0]
        device, dtype = cache.c_kv.device, cache.dtype
        width = cache.c_kv.shape[-1] + cache.k_pe.shape[-1]
        dense = [torch.zeros(1, 128, width, dtype=dtype, device=device) for _ in self.caches]
        zero = torch.zeros(1, dtype=torch.long, device=device)
        try:
            self._run(zero[None], torch.full((1,), 2, device=device), zero, 3, dense)
        except Exception as err:  # noqa: BLE001 - any compiler failure means: serve eagerly
            log.warning("compiled decode steps unavailable, decoding eagerly: %s", str(err).splitlines()[0])
            return False
        return True
