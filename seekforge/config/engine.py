"""`EngineConfig`: the serving engine's knobs, and `parse_bytes` for its memory sizes."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Serving engine knobs (serve/). `kv_cache_memory` sizes the paged latent cache: "512MiB", "2GiB"
    or a byte count; `num_kv_blocks` overrides it (tests use it to force preemption). On a CPU the
    dense decode rows (serve/kv_cache.DenseRows) may take up to as much again."""

    block_size: int = 16
    kv_cache_memory: str | int = "512MiB"
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "int8": latents per token in int8 + an fp32 scale
    speculative_tokens: int = 0  # k > 0: the model's MTP modules draft k tokens, one target pass verifies them
    num_scheduler_steps: int = 1  # N > 1: N decode steps per scheduler pass while no prefill waits
    enable_lora: bool = False  # serve LoRA adapters (serve/lora.py), loaded at start or at run time
    compile: bool = False  # decode steps as torch.compile'd programs (serve/compiled.py), compiled at start
    # plain decode steps of up to max_cuda_graph_batch sequences (and max_num_seqs) replay CUDA graphs captured at
    # start (serve/graphs.py). Acts on the GPU path only: a CUDA device (or a CPU test inside forced_gpu_path)
    cuda_graphs: bool = True
    max_cuda_graph_batch: int = 256

    def __post_init__(self):
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}: choose 'auto' or 'int8'")
        if not isinstance(self.speculative_tokens, int) or self.speculative_tokens < 0:
            raise ValueError(f"EngineConfig.speculative_tokens={self.speculative_tokens!r}: must be an integer >= 0 "
                             "(0 turns speculative decoding off)")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"EngineConfig.cuda_graphs={self.cuda_graphs!r}: must be True or False")
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps",
                    "max_cuda_graph_batch"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"EngineConfig.{key}={getattr(self, key)!r}: must be a positive integer")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks={self.num_kv_blocks}: give at least 1, or None")
        if self.speculative_tokens and self.num_scheduler_steps > 1:
            raise ValueError(f"speculative_tokens={self.speculative_tokens} and num_scheduler_steps="
                             f"{self.num_scheduler_steps} cannot be combined (as in vLLM); pick one")
        self.kv_cache_bytes = parse_bytes(self.kv_cache_memory, "EngineConfig.kv_cache_memory")

    def model_len(self, max_position_embeddings: int) -> int:
        """Tokens one sequence holds at most (prompt + output): max_model_len, else the model's
        max_position_embeddings."""
        return self.max_model_len or max_position_embeddings


def parse_bytes(size: str | int, what: str = "memory size") -> int:
    """1048576, "512MiB", "2GiB", "5GB" (10⁹ bytes, as HF's max_shard_size) → bytes. `what` names the
    setting in the error."""
    if isinstance(size, int) and size > 0:
        return size
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"{what} {size!r} is not a size; write e.g. '512MiB', '5GB' or a byte count")
    return int(float(match[1]) * units[match[2] or "B"])
