"""Decode steps as compiled programs (`EngineConfig.compile`, `seekforge serve --compile`).

A decode step is ~500 small eager ops around the matmuls. On a CPU each op costs microseconds once a streamed
weight matrix has pushed the interpreter's and the dispatcher's working set out of the caches, so at one
sequence the ops cost about as much as the matmuls. `torch.compile` (inductor) traces the step once — the
model's own modules, with the latent cache below standing in for the paged one — and fuses the ops
between the matmuls into a few generated C++ kernels: the role CUDA graphs play for vLLM's GPU decode.
It makes batch-1 decode several times faster and batched decode faster too, with the same greedy tokens
(serve_throughput.py and serve_peers.py print the compiled and the eager engine side by side; BENCHMARKS.md).

The steps it runs are the plain decode steps that read the dense decode rows (kv_cache.DenseRows): the
latents each row computes go to their pool slot, as always, and to its dense row, which attention then
reads. Three programs, each traced once with dynamic shapes (every context length, dense capacity and
batch size) and compiled at engine start (`warm_up`; minutes on 2 cores the first time, seconds from
inductor's on-disk cache): one sequence (its experts' weights read as views, model/moe.py), several
sequences of one context length, and several of different lengths (masked). Once traced, a program's compiled
graph is called directly (DirectEntry), not through dynamo's entry. A new set of decoding sequences has its
dense rows built from the pool first (eagerly, a copy), then runs compiled from its first step on (eager, its
first steps each cost several compiled ones). Everything else — prefill chunks,
speculative verifies, LoRA rows, int8 latents — runs eagerly.
"""

from __future__ import annotations

import logging
import time
import types

import torch
import torch.fx.experimental._config as shape_config

from seekforge.model import kernels
from seekforge.serve.kv_cache import AttentionMetadata, PagedLatentCache, mask_width

log = logging.getLogger("seekforge.serve")


class DenseRowsCache:
    """MLA's kv_cache inside a compiled step of B decode rows: row i's latents go to slots[i] of the layer's
    pools and to write_index[i] of `dense` (B, capacity, r + dr) viewed as rows of latents; attention reads
    the first context_len latents of every dense row (MLA.attend_absorbed's fused path), `mask` (B, 1, 1,
    context_len) hiding a shorter row's tail, or None when every row is context_len long."""

    def __init__(self, c_kv_pool, k_pe_pool, dense, slots, write_index, context_len: int, mask):
        self.c_kv_pool, self.k_pe_pool, self.dense = c_kv_pool, k_pe_pool, dense
        self.slots, self.write_index, self.context_len, self.mask = slots, write_index, context_len, mask

    def attend(self, attn, q_nope, q_pe, c_kv, k_pe):
        """q_nope (1, B, nh, dn), q_pe (1, B, nh, dr), c_kv (1, B, r), k_pe (1, B, dr) → (1, B, nh·dv)."""
        r, dr = c_kv.shape[-1], k_pe.shape[-1]
        self.c_kv_pool.view(-1, r).index_copy_(0, self.slots, c_kv[0])
        self.k_pe_pool.view(-1, dr).index_copy_(0, self.slots, k_pe[0])
        self.dense.view(-1, r + dr).index_copy_(0, self.write_index, torch.cat([c_kv[0], k_pe[0]], dim=-1))
        latents = self.dense[:, :self.context_len]
        out = attn.attend_absorbed(q_nope[0, :, None], q_pe[0, :, None], latents[..., :r], latents[..., r:],
                                   mask=self.mask, latents=latents)  # (B, 1, nh·dv)
        return out.transpose(0, 1)


def decode_rows(model, ids, positions, slots, write_index, context_len: int, mask,
                pools: list[tuple[torch.Tensor, torch.Tensor]], dense: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The traced step: ids (1, B), positions, slots, write_index (B,) → hidden before the final norm (B, H) and
    every row's fp32 logits (B, V), as Runner.logits computes them (the final norm fused here, not an eager op)."""
    for d in dense[1:]:  # every layer's dense rows have one capacity (DenseRows): one traced size, not one each
        torch._check(d.shape[1] == dense[0].shape[1])
    caches = [DenseRowsCache(c_kv, k_pe, d, slots, write_index, context_len, mask)
              for (c_kv, k_pe), d in zip(pools, dense, strict=True)]
    hidden, _, _ = model.hidden(ids, positions=positions, kv_caches=caches)
    return hidden[0], model.lm_head(model.norm(hidden[0])).float()


# One entry point per program, and each CompiledDecode compiles copies of them with code objects of their own
# (`_own_copy`): torch.compile caches compiled code on the traced function's code object, and with the guards
# skipped (below) a shared one would run whichever program, of whichever engine, was compiled first.
def decode_one(*args):
    """One sequence (B = 1: its experts' weights as views, model/moe.py)."""
    return decode_rows(*args)


def decode_uniform(*args):
    """Several sequences of one context length (no mask)."""
    return decode_rows(*args)


def decode_masked(*args):
    """Several sequences of different context lengths."""
    return decode_rows(*args)


PROGRAMS = {"one": decode_one, "rows": decode_uniform, "masked": decode_masked}


def _own_copy(fn):
    """fn with a fresh code object, so that its compiled code is this copy's alone."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _free_variable(fn, name: str):
    """The value of `name` in fn's closure, or None."""
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def inductor_entry(compiled):
    """The C++ function inductor generated for a graph that `compile_fx` compiled with cpp_wrapper: it takes the
    graph's inputs as tensor handles and returns its outputs as handles. Found through the Python wrappers
    around it (dynamo's frame switch, AOT's runtime wrapper, inductor's argument conversion); None where this
    version of torch wraps it otherwise."""
    graph = _free_variable(_free_variable(compiled, "fn"), "compiled_fn")  # dynamo's wrapper → AOT's
    entry = _free_variable(getattr(graph, "current_callable", None), "f")  # inductor's wrapper → the C++
    aoti = getattr(torch._C, "_aoti", None)
    usable = all(hasattr(aoti, name) for name in ("unsafe_alloc_void_ptrs_from_tensors",
                                                  "alloc_tensors_by_stealing_from_void_ptrs"))
    return entry if callable(entry) and usable else None


class DirectEntry:
    """A traced program's compiled graph, called without dynamo's entry (its frame hook, a prologue reading ~120
    parameters through module attributes, AOT's wrappers: a tenth or more of a batch-1 step).

    The graph's inputs are what dynamo recorded as their sources: the model's (`L['args'][0]._modules['norm']
    ._parameters['weight']`: its parameters and buffers; its config's floats are constants, `_run`) are kept as
    dynamo passed them on the tracing call, being objects whose tensors change in place (a GRPO update,
    MasterWeights' swaps of `.data`); the step's own (`L['args'][1]`, `L['args'][8][0].size()[1]`) are read on each
    call by one generated function.

    Where it can, it calls inductor's C++ function itself (`inductor_entry`), skipping the Python between it
    and dynamo (AOT's runtime wrapper, inductor's conversion of every input, each step). That is the same
    call when the graph updates the tensors it writes itself and takes the inputs dynamo passes, one for one:
    so only where no two inputs share memory (else AOT would have merged or rebased them), and once it
    returned what dynamo's entry did and wrote the rows the step writes (`matches`)."""

    def __init__(self, compiled, graphargs: list):
        sources = [arg.source.name for arg in graphargs]
        model = [i for i, source in enumerate(sources) if source.startswith("L['args'][0]")]
        if any(arg.pass_arg_as_tensor for i, arg in enumerate(graphargs) if i not in model):
            raise ValueError("a step input that dynamo converts")  # none of decode_rows' is: stay on dynamo's way
        self.compiled, self.model, self.sources = compiled, model, sources
        self.constants: list | None = None  # the model's inputs, from the tracing call (`traced`)
        self.inputs = self._reader(set())
        self.entry = None  # inductor's C++ function, once `matches` found it safe to call
        self.scalars: dict[int, torch.Tensor] = {}  # integer inputs as the 0-d tensors the C++ function reads

    def _reader(self, scalars: set[int]):
        """One generated function: the step's arguments → the graph's inputs, the integers among them (positions
        `scalars`) as tensors."""
        fields = [f"C[{self.model.index(i)}]" if i in self.model else
                  f"S({source})" if i in scalars else source for i, source in enumerate(self.sources)]
        return eval(f"lambda L, C, S: [{', '.join(fields)}]")  # noqa: S307 - the sources are dynamo's code

    def scalar(self, value: int) -> torch.Tensor:
        """An integer input (a context length) as the 0-d tensor inductor's C++ function reads, made once per value:
        a `torch.tensor` each step was one of the per-step costs this entry removes."""
        tensor = self.scalars.get(value)
        if tensor is None:
            if len(self.scalars) > 4096:  # context lengths: bounded by the model's, kept from growing regardless
                self.scalars.clear()
            tensor = self.scalars[value] = torch.tensor(value)
        return tensor

    def traced(self, *inputs):
        """Dynamo's call of the compiled graph: keep the model's inputs as it passed them."""
        self.constants = [inputs[i] for i in self.model]
        return self.compiled(*inputs)

    def __call__(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.inputs({"args": args}, self.constants, self.scalar)
        if self.entry is None:
            out = self.compiled(*inputs)
        else:
            aoti = torch._C._aoti
            out = aoti.alloc_tensors_by_stealing_from_void_ptrs(self.entry(aoti.unsafe_alloc_void_ptrs_from_tensors(
                inputs)))
        return out[0], out[1]

    def matches(self, args: tuple, expected: tuple[torch.Tensor, torch.Tensor],
                written: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Does this entry return what dynamo's entry just returned for `args`, and write the rows the step writes
        (`written`: (rows, index) pairs)? A step run twice is the same step (it writes the same latents to the
        same slots before reading them); the written rows are zeroed first, so that only the call checked can
        have written them. Checked once, after tracing: calling inductor's function itself, else dynamo's graph."""
        if self.constants is None:
            return False
        inputs = self.inputs({"args": args}, self.constants, self.scalar)
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        scalars = {i for i, value in enumerate(inputs) if isinstance(value, int)}
        # AOT merges an input passed twice and rebases inputs that share memory with one the graph writes: its
        # graph then takes other inputs than dynamo's, which only its own wrapper passes right
        storages = [t.untyped_storage().data_ptr() for t in tensors]
        one_for_one = len({id(t) for t in tensors}) == len(tensors) and all(
            storages.count(rows.untyped_storage().data_ptr()) == 1 for rows, _ in written)
        entry = inductor_entry(self.compiled) if one_for_one else None
        saved = [rows[index].clone() for rows, index in written]
        if entry is not None:
            self.entry, self.inputs = entry, self._reader(scalars)
            if self._same(args, expected, written, saved):
                return True
        self.entry, self.inputs = None, self._reader(set())
        return self._same(args, expected, written, saved)

    def _same(self, args, expected, written, saved) -> bool:
        """Run the step through this entry (its written rows zeroed first): its outputs and the rows as expected?
        The rows are left as the step wrote them either way."""
        for rows, index in written:
            rows[index] = 0
        try:
            out = self(args)
        except Exception:  # noqa: BLE001 - inputs read wrongly: another way in
            out = None
        same = out is not None and all(torch.equal(a, b) for a, b in zip(out, expected, strict=True)) and all(
            torch.equal(rows[index], want) for (rows, index), want in zip(written, saved, strict=True))
        for (rows, index), want in zip(written, saved, strict=True):
            rows[index] = want
        return same


class CompiledDecode:
    """The compiled decode steps over a runner's pools and dense rows."""

    def __init__(self, model, caches: list[PagedLatentCache]):
        self.model = model
        self.caches = caches
        # dynamic: each program serves every context length, dense capacity and batch size. fullgraph: a graph
        # break would bring back the eager ops this exists to remove, so tracing one is an error. No guards:
        # checking them read every parameter's metadata every step; each program is called only in the
        # kind of step it was traced for (`applies`, `__call__`), on the same modules. The backend: `_backend`.
        self.programs = {name: torch.compile(_own_copy(fn), backend=self._backend(name), dynamic=True, fullgraph=True,
                                             options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
                         for name, fn in PROGRAMS.items()}
        self.entries: dict[str, DirectEntry] = {}
        self.traced: set[str] = set()  # the programs compiled already
        # The pools keep their shapes for the engine's life (a GRPO rollout allocates them again alike), so their
        # sizes are traced as constants: as symbols they were 24 integers a step that dynamo's prologue read from
        # the tensors and the C++ wrapper took as tensors.
        for cache in caches:
            torch._dynamo.mark_static(cache.c_kv)
            torch._dynamo.mark_static(cache.k_pe)

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
        """Is this step plain decodes from dense rows (every token a decode row)? Context lengths from 2 on:
        torch.compile specializes a size that is 1, and the programs skip the guard that checks."""
        step = metadata.dense
        return (step is not None and metadata.num_decodes == ids.shape[1] and step.context_len >= 2
                and metadata.lora is None)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """→ hidden before the final norm (B, H) and fp32 logits (B, V), the pools and dense rows updated as the
        eager step does."""
        step, rows = metadata.dense, ids.shape[1]
        if step.rebuild:  # the rows from the pool, which holds every token but this step's: the step writes that
            for cache in self.caches:
                cache.build_dense(metadata)
        scratch = self.caches[0].scratch
        dense = [scratch.buffers[f"dense{c.layer}"][:rows] for c in self.caches]
        # contiguous, as the warm-up's: a program is traced for one layout of each input
        mask = None if step.uniform else mask_width(metadata.decode_mask, step.context_len).contiguous()
        program = "one" if rows == 1 else "rows" if mask is None else "masked"
        return self._run(program, ids, positions, metadata.slot_mapping, step.write_index, step.context_len, mask,
                         dense)

    def _run(self, program, ids, positions, slots, write_index, context_len, mask, dense):
        pools = [(c.c_kv, c.k_pe) for c in self.caches]
        args = (self.model, ids, positions, slots, write_index, context_len, mask, pools, dense)
        entry = self.entries.get(program)
        if entry is not None:
            return entry(args)
        if program in self.traced:  # the settings below matter to tracing only, and patching them costs every step
            return self.programs[program](*args)
        # capture_scalar_outputs: the chosen experts' ids and the expert batch's size as traced integers
        # (model/moe.py). specialize_float: the model's floats (its config's epsilons and scales) as the constants
        # they are. As graph inputs, the ~13 a program passes on to an op that takes a Python float (an RMSNorm's
        # epsilon, the attention kernel's scale) cannot become tensors, and dynamo restarted the whole trace to
        # specialize them: each program was traced twice, and an engine started from the compile cache took
        # about three times as long. No duck shapes: two sizes that happen to be equal when traced (two layers' dense
        # capacities, say) must not become one symbol, as nothing checks them later.
        with torch._dynamo.config.patch(capture_scalar_outputs=True, specialize_float=True), \
                shape_config.patch(use_duck_shape=False):
            out = self.programs[program](*args)
        self.traced.add(program)
        entry = self.entries.get(program)
        if entry is not None and not entry.matches(args, out, self._written(slots, write_index, dense)):
            del self.entries[program]  # reads its inputs otherwise than dynamo does: keep dynamo's entry
        return out

    def _written(self, slots, write_index, dense) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rows a step writes, as (rows, index): its latents' pool slots and dense rows, every layer's."""
        written = []
        for cache, d in zip(self.caches, dense, strict=True):
            written += [(cache.c_kv.view(-1, cache.c_kv.shape[-1]), slots),
                        (cache.k_pe.view(-1, cache.k_pe.shape[-1]), slots), (d.view(-1, d.shape[-1]), write_index)]
        return written

    def _backend(self, program: str):
        """torch.compile's backend for `program`: inductor, the step's kernels called from generated C++ (cpp_wrapper: a
        faster batch 1 than inductor's Python wrapper) without checking the sizes and strides of every input and kernel
        output at every step (~300 calls; the traced shapes already say them), our kernels called through their C entry
        points, not the dispatcher (kernels.c_shims); and the compiled graph kept with where each of its inputs comes
        from, for DirectEntry."""
        def compile(gm: torch.fx.GraphModule, example_inputs, **_):
            from torch._inductor.compile_fx import compile_fx  # imports dynamo: only when a program is traced

            compiled = compile_fx(gm, example_inputs, config_patches={
                "cpp_wrapper": True, "size_asserts": False, "aot_inductor.custom_ops_to_c_shims": kernels.c_shims()})
            try:
                entry = DirectEntry(compiled, [node.meta["grapharg"] for node in gm.graph.find_nodes(op="placeholder")])
            except (KeyError, AttributeError, ValueError, SyntaxError):  # graphs of another torch: dynamo's way only
                return compiled
            self.entries[program] = entry
            return entry.traced
        return compile

    @torch.inference_mode()
    def warm_up(self) -> bool:
        """Compile every program now, on scratch steps (the first slots of the pools: free at start, and a slot
        is always written before it is read). False, with a warning, where compiling fails (e.g. no C++
        compiler): the engine then decodes eagerly."""
        cache = self.caches[0]
        device, dtype = cache.c_kv.device, cache.dtype
        width = cache.c_kv.shape[-1] + cache.k_pe.shape[-1]
        context_len, capacity = 5, 128  # sizes no other input has, none of them 1
        log.info("compiling the decode steps (torch.compile, %d programs; ~2 min on 2 cores the first time, "
                 "less from the compile cache)", len(self.programs))
        start = time.perf_counter()
        for program, rows in (("one", 1), ("rows", 3), ("masked", 3)):
            dense = [torch.zeros(rows, capacity, width, dtype=dtype, device=device) for _ in self.caches]
            ids = torch.zeros(1, rows, dtype=torch.long, device=device)
            positions = torch.full((rows,), context_len - 1, device=device)
            slots = torch.arange(rows, device=device)
            write_index = torch.arange(rows, device=device) * capacity + context_len - 1
            mask = torch.ones(rows, 1, 1, context_len, dtype=torch.bool, device=device) if program == "masked" else None
            try:
                self._run(program, ids, positions, slots, write_index, context_len, mask, dense)
            except Exception as err:  # noqa: BLE001 - any compiler failure means: serve eagerly
                log.warning("compiled decode steps unavailable, decoding eagerly: %s", str(err).splitlines()[0])
                return False
        log.info("decode steps compiled in %.0f s", time.perf_counter() - start)
        return True
