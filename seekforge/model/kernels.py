"""CPU kernels of our own, compiled on first use (csrc/): decode attention over MLA latents and linear layers
over a few rows. Each exists because PyTorch's CPU path for the same call is slower on AVX-512 CPUs without AMX;
what each gains is measured by benchmarks/cpu_kernels.py (BENCHMARKS.md, cpu_kernels.py).

Decode attention (csrc/latent_attention.cpp). At decode, each sequence's heads are the query rows of one
attention over its latents [c_kv | k_pe] (MLA._attend_latents). PyTorch's flash kernel runs that as two small
GEMM calls per sequence, and at M = 8 rows (the `small` preset's heads) their per-call costs dominate; this kernel
reads each latent row once for both passes. At long contexts attention is most of a batch-1 step: the kernel
requests the latent rows ahead of the scores pass (the weights' stream has evicted them since the last step) and
splits one sequence's latents over the threads (serve_throughput.py --batch1-context measures it).

Linear layers over one to four rows (csrc/linear_rows.cpp: batch-1 decode, the chosen experts of one token, MLA's
absorbed per-head products). There a linear layer is a stream over its weight, each value used once, and the
speed limit is the memory bandwidth: oneDNN's bf16 GEMM and MKL's fp32 GEMM read such weights well below what a
plain sum streams, and the kernel, which reads each weight row front to back, comes closer to it. oneDNN's bf16
bmm also copies the absorbed products' per-head views (a gap between the heads) into contiguous ones at every
call, which the kernel reads in place. A token's chosen experts run as one call per projection over the stacked
experts' weights (linear_rows_indexed), which reads the chosen ones in place instead of a call per expert. Each
thread requests its weight stream 8 KiB ahead of its reads (the hardware prefetchers start every small weight
cold), the absorbed key products included (they read a (64, r) block per head, the slowest call of a step from
memory without it).

On CPUs with AMX PyTorch's kernels run bf16 on AMX tiles and keep decode attention fast; these kernels have no AMX
path and are not used there.

They are built with torch.utils.cpp_extension (a C++ compiler and ninja, the same toolchain torch.compile needs
on a CPU) into torch's extension cache, once per machine and torch install (tens of seconds); a process then
loads them in milliseconds.
Where they cannot be built, or SEEKFORGE_CPU_KERNELS=0, PyTorch's kernels run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
MAX_LINEAR_ROWS = 4  # linear_rows' query rows per pass over the weight (more run in passes of 4)
_loaded: bool | None = None  # None: not tried yet


def cpu_kernels_wanted() -> bool:
    """Does this CPU run our kernels better than PyTorch's: AVX-512 without AMX (see the module docstring)."""
    if os.environ.get("SEEKFORGE_CPU_KERNELS") == "0":
        return False
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and not torch.cpu._is_amx_tile_supported()


def load() -> bool:
    """Build (once per machine) and load the kernels when this CPU wants them; True when they are ready.
    Call it before tracing (the engine does, when it builds its caches): a build inside torch.compile's
    tracing would stall it."""
    global _loaded
    if _loaded is None:
        _loaded = cpu_kernels_wanted() and build()
    return _loaded


def ready() -> bool:
    """Loaded already (no build attempted here): what the hot paths ask."""
    return bool(_loaded)


_shims_visible = False  # are the kernels' C entry points visible to other libraries (build)?


def c_shims() -> dict:
    """torch.compile's `aot_inductor.custom_ops_to_c_shims` for the loaded kernels: each op → the declaration of its
    C entry point (csrc/c_shims.h), which code generated with cpp_wrapper calls directly instead of through the
    dispatcher by name. Empty where the kernels are not loaded, or their library is not visible to that code."""
    if not (ready() and _shims_visible):
        return {}
    c_types = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "float": "double",
               "int": "int64_t"}

    def declaration(op) -> str:  # the op's schema, argument by argument, then the result's handle
        args = [f"{c_types[str(a.type)]} {a.name}" for a in op._schema.arguments] + ["AtenTensorHandle* ret0"]
        return f"AOTITorchError aoti_torch_cpu_{op._schema.name.split('::')[1]}({', '.join(args)})"

    ops = [getattr(torch.ops.seekforge, name).default
           for name in ("linear_rows", "rows_times", "linear_rows_indexed", "latent_attention")]
    return _ShimTable({op: [declaration(op)] for op in ops})


class _ShimTable(dict):
    """c_shims' table, pickled by its ops' names: inductor pickles its config into the key of its compiled-graph
    cache, and an op itself does not pickle (with it in the config, every engine start compiled anew)."""

    def __reduce__(self):
        return dict, ({str(op): declarations for op, declarations in self.items()},)


def attention_takes(latents: torch.Tensor) -> bool:
    """The latent-attention kernel's inputs: CPU fp32/bf16 latents with contiguous rows."""
    return latents.device.type == "cpu" and latents.dtype in (torch.float32, torch.bfloat16) and latents.stride(-1) == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by the few-rows kernel where it takes the call (see linear_takes)."""
    if _loaded and linear_takes(x, weight, bias):
        return torch.ops.seekforge.linear_rows(x, weight, bias)
    return F.linear(x, weight, bias)


def bmm_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch.bmm(x, weight.transpose(1, 2)) for x (G, M, K) and weight (G, N, K) (MLA's absorbed value weights,
    a view with a gap between heads), by the kernel where it takes the call: oneDNN's bf16 bmm first copies such
    a view into a contiguous transposed one, which at batch 1 costs more than the product itself."""
    if _loaded and linear_takes(x, weight, grouped=True):
        return torch.ops.seekforge.linear_rows(x, weight, None)
    return torch.bmm(x, weight.transpose(1, 2))


def linear_indexed(x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """torch.bmm(x, weight[index].transpose(1, 2)) for x (G, M, K), a stack of weights (E, N, K) and G ids (a
    token's chosen experts), by the kernel where it takes the call, which reads the chosen weights in place;
    weight[index] copies them."""
    if _loaded and linear_takes(x, weight, grouped=True):
        return torch.ops.seekforge.linear_rows_indexed(x, weight, index)
    return torch.bmm(x, weight[index].transpose(1, 2))


def bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch.bmm(x, weight) for x (G, M, K) and weight (G, K, N) (MLA's absorbed key weights), by the kernel where
    it takes the call (see bmm_t)."""
    if _loaded and linear_takes(x, weight, grouped=True):
        return torch.ops.seekforge.rows_times(x, weight)
    return torch.bmm(x, weight)


def linear_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, grouped: bool = False
                 ) -> bool:
    """Inference (the kernels have no backward) of at most MAX_LINEAR_ROWS rows (per group when `grouped`: x (G,
    M, K)) with CPU fp32/bf16 tensors of one dtype and a plain weight (not a DTensor or a quantized one) whose
    rows are contiguous. Traced by torch.compile, one row only: torch.compile specializes a size of 1, so a
    dynamic batch size is never 1 and a program traced for every batch size (serve/compiled.py) keeps PyTorch's
    kernel, where `<= MAX_LINEAR_ROWS` would bake in what its traced size said."""
    if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    rows = x.shape[1] if grouped else math.prod(x.shape[:-1])
    limit = 1 if torch.compiler.is_compiling() else MAX_LINEAR_ROWS
    return (rows <= limit and weight.dtype == x.dtype
            and type(weight) in (torch.Tensor, nn.Parameter) and weight.dim() == (3 if grouped else 2)
            and weight.stride(-1) == 1 and weight.stride(-2) == weight.shape[-1] and (grouped or weight.is_contiguous())
            and (bias is None or (bias.dtype == x.dtype and type(bias) in (torch.Tensor, nn.Parameter)
                                  and bias.is_contiguous())))


class Linear(nn.Linear):
    """nn.Linear whose inference over a few rows runs the linear_rows kernel where it is loaded (the model's
    linear layers are these; parameters, state dict and hooks are nn.Linear's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@functools.cache
def build() -> bool:
    """Compile (or find in torch's extension cache) and load the kernels on any AVX-512 CPU, and register their
    shape functions for torch.compile; True when the torch.ops.seekforge ops exist."""
    from torch.utils import cpp_extension

    global _shims_visible
    if shutil.which(os.environ.get("CXX", "c++")) is None or not cpp_extension.is_ninja_available():
        log.warning("no C++ compiler or ninja: PyTorch's kernels run (decode is slower on this CPU)")
        return False
    # -fopenmp: at::parallel_for splits the work over torch's OpenMP threads only when compiled with it
    flags = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    # the name carries a hash of sources and flags, an edited kernel rebuilt and never an old build loaded; and of the
    # torch it builds against: its build files name that torch's headers and libraries, so two environments sharing
    # one build folder would rebuild it each time the other had loaded it
    text = "".join(source.read_text() for source in SOURCES + HEADERS) + " ".join(flags) + \
        f" torch {torch.__version__} at {os.path.dirname(torch.__file__)}"
    name = f"seekforge_cpu_kernels_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    log.info("loading the CPU kernels %s (the first use on a machine compiles them, ~20-60 s)", name)
    try:
        library = cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=flags, is_python_module=False,
                                     verbose=False)
    except Exception as e:  # a broken toolchain must not stop serving: the fallbacks are correct, only slower
        log.warning("the CPU kernels did not build (%s): PyTorch's kernels run", e)
        return False
    try:  # loaded with RTLD_LOCAL: made global, so that compiled code resolves the C entry points (c_shims)
        ctypes.CDLL(library, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except (OSError, TypeError) as e:
        log.warning("compiled steps call the CPU kernels through the dispatcher (%s)", e)
    else:
        _shims_visible = True

    @torch.library.register_fake("seekforge::latent_attention")
    def _(q, latents, lengths, scale, value_dim):
        return q.new_empty(q.shape[0], q.shape[1], value_dim)

    @torch.library.register_fake("seekforge::linear_rows")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[-2])

    @torch.library.register_fake("seekforge::linear_rows_indexed")
    def _(x, weight, index):
        return x.new_empty(x.shape[0], x.shape[1], weight.shape[1])

    @torch.library.register_fake("seekforge::rows_times")
    def _(x, weight):
        return x.new_empty(x.shape[0], x.shape[1], weight.shape[2])

    return True
