"""Configuration dataclasses.

`ModelConfig` uses exactly the keys of a DeepSeek-V3 Hugging Face `config.json`, so a real
checkpoint's config loads unchanged (`ModelConfig.from_hf`). Keys seekforge does not know are kept in
`extra` and written back on save, never interpreted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128  # MLA ignores it; kept for HF round trips
    q_lora_rank: int | None = 1536  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str = "noaux_tc"  # "noaux_tc" (V3), "greedy" / "group_limited_greedy" (V2)
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # YaRN: {"type": "yarn", "factor", "original_max_position_embeddings", ...}
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), times mscale² under YaRN: the attention-entropy correction of YaRN §3.4
        is applied to both q and k, so the logits scale by its square (as HF and DeepSeek do)."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope_scaling or {}
        if rope_type(rope) == "yarn":
            mscale_all_dim = rope.get("mscale_all_dim", 0)
            if mscale_all_dim:
                m = yarn_get_mscale(yarn_factor(self), mscale_all_dim)
                scale *= m * m
        return scale

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def bad(key, msg):
            raise ValueError(f"ModelConfig.{key}={getattr(self, key)!r}: {msg}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "intermediate_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                bad(key, "must be a positive integer")
        if self.qk_nope_head_dim < 0:
            bad("qk_nope_head_dim", "must be >= 0")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "RoPE rotates pairs of dims; use an even number such as 64")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            bad("q_lora_rank", "must be a positive integer, or null for a plain q_proj")
        if self.n_routed_experts < 0 or self.n_shared_experts < 0:
            bad("n_routed_experts", "expert counts must be >= 0")
        if self.n_routed_experts:
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size", "must be positive when n_routed_experts > 0")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                bad("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                bad("topk_group", f"must be in [1, n_group={self.n_group}]; lower topk_group or raise n_group")
            per_group = self.n_routed_experts // self.n_group
            if self.n_group > 1 and self.topk_method == "noaux_tc" and per_group < 2:
                bad("n_group", "noaux_tc scores a group by its top-2 experts; each group needs >= 2 experts")
            if self.topk_group * per_group < self.num_experts_per_tok:
                bad("topk_group", f"topk_group * experts per group = {self.topk_group * per_group} < "
                    f"num_experts_per_tok={self.num_experts_per_tok}; raise topk_group")
        if self.scoring_func not in ("sigmoid", "softmax"):
            bad("scoring_func", "must be 'sigmoid' (DeepSeek-V3) or 'softmax' (DeepSeek-V2)")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            bad("topk_method", "must be one of 'noaux_tc', 'greedy', 'group_limited_greedy'")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            bad("first_k_dense_replace", f"must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.num_nextn_predict_layers < 0:
            bad("num_nextn_predict_layers", "must be >= 0")
        if self.hidden_act != "silu":
            bad("hidden_act", "only 'silu' (SwiGLU) is used by DeepSeek models")
        if self.rope_scaling is not None:
            kind = rope_type(self.rope_scaling)
            if kind not in ("yarn", "default"):
                bad("rope_scaling", f"rope type {kind!r} is not supported; use 'yarn' or null")
            if kind == "yarn" and "original_max_position_embeddings" not in self.rope_scaling:
                bad("rope_scaling", "YaRN needs 'original_max_position_embeddings'")

    # ------------------------------------------------------------------ HF round trip
    @classmethod
    def from_hf(cls, source: str | Path | dict) -> ModelConfig:
        """Read a DeepSeek-V3 `config.json` (a dict, a file, or a directory holding one)."""
        if isinstance(source, dict):
            raw = dict(source)
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise ValueError(f"{path} does not exist; pass a checkpoint directory with a config.json")
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON ({e}); re-download or fix the file") from e
        # transformers >= 5 writes `rope_parameters` (theta inside) instead of rope_theta/rope_scaling.
        rope = raw.pop("rope_parameters", None)
        if rope is not None:
            rope = dict(rope)
            raw.setdefault("rope_theta", rope.pop("rope_theta", 10000.0))
            if rope_type(rope) != "default":
                raw.setdefault("rope_scaling", rope)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        if known.get("num_key_value_heads") is None:
            known["num_key_value_heads"] = known.get("num_attention_heads", cls.num_attention_heads)
        return cls(**known, extra=extra)

    def to_hf(self) -> dict:
        """The config.json dict, in the official DeepSeek-V3 layout (rope_theta + rope_scaling)."""
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        out["model_type"] = "deepseek_v3"
        out["architectures"] = ["DeepseekV3ForCausalLM"]
        # transformers 5 derives these from the rope dims; keeping stale copies would contradict them.
        for stale in ("head_dim", "qk_head_dim", "rope_parameters"):
            out.pop(stale, None)
        return out

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ parameter counts
    def num_params(self) -> dict[str, int]:
        """Exact parameter counts, computed from the config alone (no tensors allocated)."""
        h, v = self.hidden_size, self.vocab_size
        nh = self.num_attention_heads
        if self.q_lora_rank is None:
            q = h * nh * self.qk_head_dim
        else:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nh * self.qk_head_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + nh * self.v_head_dim * h + 2 * h  # + both layer norms
        dense_mlp = 3 * h * self.intermediate_size
        expert = 3 * h * self.moe_intermediate_size
        gate = self.n_routed_experts * h + self.n_routed_experts
        shared = self.n_shared_experts * expert

        def layer(moe: bool, active: bool) -> int:
            if not moe:
                return attn + dense_mlp
            routed = (self.num_experts_per_tok if active else self.n_routed_experts) * expert
            return attn + gate + shared + routed

        embed = v * h
        head = 0 if self.tie_word_embeddings else v * h
        moe_flags = [self.is_moe_layer(i) for i in range(self.num_hidden_layers)]
        total = embed + head + h + sum(layer(m, False) for m in moe_flags)
        active = embed + head + h + sum(layer(m, True) for m in moe_flags)
        # An MTP module: enorm + hnorm + eh_proj + one (MoE) block + its final norm; embedding and
        # head are shared with the main model.
        mtp_moe = self.n_routed_experts > 0
        mtp = self.num_nextn_predict_layers * (2 * h + 2 * h * h + layer(mtp_moe, False) + h)
        return {"total": total, "active": active, "mtp": mtp}


def rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(cfg: ModelConfig) -> float:
    rope = cfg.rope_scaling or {}
    factor = rope.get("factor")
    if factor is None:  # DeepSeek convention: ratio of the extended to the original context
        factor = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
    return float(factor)


_V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: every feature on (q low-rank, groups, dense + MoE layers, MTP), < 2M parameters.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                 n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                 first_k_dense_replace=1, num_nextn_predict_layers=1, max_position_embeddings=512),
    # Benchmarks and the default pretraining run: ~45M parameters, 16 experts, top-4.
    "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
                  num_hidden_layers=6, num_attention_heads=8, q_lora_rank=192, kv_lora_rank=128,
                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
                  n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                  first_k_dense_replace=1, num_nextn_predict_layers=1, max_position_embeddings=2048),
    "v2-lite": dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                    num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                    num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                    norm_topk_prob=False, scoring_func="softmax", topk_method="greedy",
                    first_k_dense_replace=1, num_nextn_predict_layers=0, max_position_embeddings=163840,
                    rope_interleave=True, bos_token_id=100000, eos_token_id=100001,
                    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                  "mscale_all_dim": 0.707}),
    "v3-671b": dict(max_position_embeddings=163840, rope_scaling=_V3_YARN),
}


def read_config_file(path: str | Path, holds: str = "TrainConfig keys") -> dict[str, Any]:
    """A YAML or TOML config file (pretrain's, GRPO's, a quantization recipe, a probe config) → its mapping of
    `holds`; a clear error for anything else."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            raw = yaml.safe_load(text) or {}
        else:
            raise ValueError(f"config file {path}: use a .yaml, .yml or .toml extension")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"config file {path} does not parse: {' '.join(str(e).split())}") from e  # one line
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a mapping of {holds}")
    return raw


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


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

    def __post_init__(self):
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r}: choose 'auto' or 'int8'")
        if not isinstance(self.speculative_tokens, int) or self.speculative_tokens < 0:
            raise ValueError(f"EngineConfig.speculative_tokens={self.speculative_tokens!r}: must be an integer >= 0 "
                             "(0 turns speculative decoding off)")
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"EngineConfig.{key}={getattr(self, key)!r}: must be a positive integer")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks={self.num_kv_blocks}: give at least 1, or None")
        if self.speculative_tokens and self.num_scheduler_steps > 1:
            raise ValueError(f"speculative_tokens={self.speculative_tokens} and num_scheduler_steps="
                             f"{self.num_scheduler_steps} cannot be combined (as in vLLM); pick one")
        self.kv_cache_bytes = parse_bytes(self.kv_cache_memory, "EngineConfig.kv_cache_memory")


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


# ---------------------------------------------------------------------------------------- parallel
PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                      "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def parse_parallel(spec: str) -> dict[str, Any]:
    """"dp_shard=2,tp=2,pp_split_points=[2,4]" → {"dp_shard": 2, "tp": 2, "pp_split_points": [2, 4]}
    (ParallelConfig keys; YAML values; commas inside [...] belong to the value)."""
    out: dict[str, Any] = {}
    for item in re.split(r",(?![^\[]*\])", spec):
        key, eq, text = item.strip().partition("=")
        if not eq or not key or not text:
            raise ValueError(f"--parallel {spec!r}: {item!r} is not key=value; write e.g. "
                             "--parallel dp_shard=2,tp=2 (keys of ParallelConfig in seekforge/config.py)")
        out[key] = yaml.safe_load(text)
    return out


@dataclass
class ParallelConfig:
    """How a model is laid out over ranks. world size = pp · dp_replicate · dp_shard · tp.

    dp_replicate × dp_shard is HSDP (FSDP within a shard group, replicas across); dp_shard alone is
    FSDP. Expert parallelism borrows ranks from dp_shard (as in torchtitan): `ep` must divide it, and
    each expert's weights are FSDP-sharded over the remaining dp_shard / ep ranks.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    sequence_parallel: bool = False  # with tp > 1: norms run on T/tp tokens (parallel/tp.py)
    pp_schedule: str = "1F1B"
    microbatches: int = 1  # pipeline micro-batches per step
    pp_split_points: list[int] | None = None  # first layer of stages 1..n-1; None: even split
    recompute: str | list[str] = "none"  # see parallel/recompute.py
    compile: bool = False
    mixed_precision: str = "fp32"  # "bf16": bf16 params/compute with fp32 gradient reduction

    def __post_init__(self):
        for key in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "microbatches"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{key}={value!r}: must be a positive integer")
        if self.pp_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"ParallelConfig.pp_schedule={self.pp_schedule!r}: choose one of {PIPELINE_SCHEDULES}")
        if self.mixed_precision not in ("fp32", "bf16"):
            raise ValueError(f"ParallelConfig.mixed_precision={self.mixed_precision!r}: use 'fp32' or 'bf16'")
        if self.sequence_parallel and self.pp > 1:
            raise ValueError("sequence_parallel=True with pp > 1 is not supported (pipeline stages would see "
                             "T/tp positions); set sequence_parallel=False or pp=1")
        if self.dp_shard % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp_shard={self.dp_shard}: experts are split over "
                             f"data-parallel ranks; pick ep in {_divisors(self.dp_shard)} or raise dp_shard")
        # Checked here, not in validate: they need no model, so `plan schedule` applies them too.
        if self.pp > 1:
            if self.microbatches < self.pp:
                raise ValueError(f"microbatches={self.microbatches} < pp={self.pp} leaves stages idle; "
                                 f"use microbatches >= {self.pp}")
            if self.pp_schedule == "DualPipeV" and self.microbatches < self.num_stages:
                raise ValueError(f"DualPipeV needs microbatches >= num_stages={self.num_stages} (two stages per "
                                 f"pp rank); got {self.microbatches}: use microbatches >= {self.num_stages}")

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> ParallelConfig:
        """A `parallel` table (--parallel, a config file's `parallel:`) as a ParallelConfig; an unknown key
        is a ValueError listing the valid ones, not a TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - names)
        if unknown:
            raise ValueError(f"parallel has unknown key(s) {unknown}; valid ParallelConfig keys: {sorted(names)}")
        return cls(**table)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    def validate(self, world_size: int, model: ModelConfig) -> None:
        """Everything that can be checked before a process group exists; one ValueError naming the fix."""
        if world_size != self.world_size:
            rest = self.world_size // self.dp_shard
            hint = f"dp_shard={world_size // rest}" if world_size % rest == 0 else "a layout whose product matches"
            raise ValueError(f"pp*dp_replicate*dp_shard*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*"
                             f"{self.tp} = {self.world_size}, but the world size is {world_size}; "
                             f"use {hint}")
        if model.num_attention_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide num_attention_heads={model.num_attention_heads}; "
                             f"pick tp in {_divisors(model.num_attention_heads)}")
        for key in ("vocab_size", "intermediate_size", "moe_intermediate_size"):
            if getattr(model, key) % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {key}={getattr(model, key)}; "
                                 f"pick tp in {_divisors(getattr(model, key))}")
        if self.ep > 1 and model.n_routed_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide n_routed_experts={model.n_routed_experts}; "
                             f"pick ep in {_divisors(model.n_routed_experts)}")
        if self.pp > 1:
            if self.num_stages > model.num_hidden_layers:
                raise ValueError(f"pp={self.pp} with {self.pp_schedule} needs {self.num_stages} stages but the "
                                 f"model has num_hidden_layers={model.num_hidden_layers}; every stage needs a "
                                 f"layer: lower pp or use a single-stage schedule such as 1F1B")
            points = self.pp_split_points
            if points is not None and (len(points) != self.num_stages - 1 or list(points) != sorted(set(points))
                                       or points[0] < 1 or points[-1] >= model.num_hidden_layers):
                raise ValueError(f"pp_split_points={points}: need {self.num_stages - 1} increasing layer ids in "
                                 f"[1, {model.num_hidden_layers - 1}] (the first layer of each later stage)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------------------- train
def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's --split: "969,30,1" → the train, valid and test shares of each dataset's documents,
    normalized (0.969, 0.03, 0.001); missing trailing weights are 0 ("99,1" → valid 1%, no test)."""
    try:
        weights = [float(w) for w in split.split(",")]
    except (AttributeError, ValueError):  # not a string, or a field that is not a number
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {split!r} is not 'TRAIN,VALID,TEST' document weights; give up to three "
                         "non-negative numbers with a positive sum, e.g. '969,30,1' (Megatron's --split)")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


@dataclass
class TrainConfig:
    """One pretraining run. YAML/TOML files map 1:1 onto these fields (train/config_file.py);
    `model` overrides the preset's ModelConfig keys (e.g. {"num_hidden_layers": 4})."""

    preset: str = "small"
    model: dict[str, Any] = field(default_factory=dict)
    data: str = "builtin:text"  # builtin:arithmetic | builtin:text | Megatron prefix | blend string
    tokenizer: str = "byte"  # "byte" or a tokenizer.json directory
    seq_len: int = 256
    micro_batch_size: int = 8
    grad_accum: int = 1
    steps: int = 500
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    schedule: str = "cosine"  # "cosine" | "wsd" (warmup-stable-decay)
    decay_fraction: float = 0.2  # WSD: share of the steps spent decaying to min_lr
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0  # global grad-norm clip; 0 disables
    # "auto": bf16 where the hardware runs it fast for this model's width (model/precision.resolve_dtype), else fp32 |
    # "bf16": bf16 compute over fp32 master weights (one process: persistent bf16 matmul weights,
    # train/master.py; FSDP2: its MixedPrecisionPolicy; activations: autocast) | "fp32"
    dtype: str = "auto"
    mtp_loss_scale: float = 0.3
    aux_loss_coeff: float = 1e-4  # sequence-wise balance loss (DeepSeek-V3 uses a tiny α)
    # Aux-loss-free balancing γ. DeepSeek-V3 used 1e-3 over ~10⁵ steps; a run of a few hundred steps
    # needs a faster bias or the router collapses onto a few experts before the bias catches up.
    bias_update_speed: float = 1e-2
    recompute: str = "none"  # "none" | "full" | "selective"
    compile: bool = False  # torch.compile each block
    # ParallelConfig keys for a torchrun job, e.g. {"dp_shard": 2, "tp": 2}; {} on one process
    # (`--parallel dp_shard=2,tp=2` on the command line, a `parallel:` table in a config file).
    parallel: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    out_dir: str = "runs/default"
    log_interval: int = 25
    eval_interval: int = 100  # steps between held-out loss evaluations; 0 disables
    eval_batches: int = 4
    # Megatron's --split: train,valid,test shares of every dataset's documents (contiguous ranges), so
    # the held-out loss reads only documents training never sees. Megatron's own default: the same
    # held-out documents as a Megatron run on the same files, and for the default run's built-in
    # corpus only 3% more text to generate (a 38k-token valid range for its 8k eval tokens).
    split: str = "969,30,1"
    save_interval: int = 100  # 0: save only at the end
    keep_checkpoints: int = 2
    resume: bool = True  # continue from out_dir/checkpoints/latest when it exists
    # A damaged latest checkpoint (its manifest disagrees with its files): resume from the newest intact
    # older one with a warning; False stops with an error naming the bad file instead.
    checkpoint_fallback: bool = True
    # Under torchrun: the longest any collective may wait for the other ranks. A hung or dead rank then
    # stops the job after this long (naming the rank) and torchrun --max-restarts can restart it.
    dist_timeout_s: float = 600.0
    peak_flops: float = 0.0  # FLOP/s for MFU; 0: measure with a matmul probe
    export_hf: bool = True  # write out_dir/hf at the end
    sample_prompt: str = "Once upon a time"  # printed generation at the end (the stories' opening); "" skips it
    probe: str = ""  # probe config YAML (dump/monitor/trace tables, seekforge/probe/config.py); "" = timing only

    def __post_init__(self):
        self.betas = tuple(self.betas)
        self.validate()

    def validate(self) -> None:
        def bad(key, msg):
            raise ValueError(f"TrainConfig.{key}={getattr(self, key)!r}: {msg}")

        if self.preset not in PRESETS:
            bad("preset", f"choose one of {sorted(PRESETS)}")
        for key in ("seq_len", "micro_batch_size", "grad_accum", "steps", "eval_batches", "keep_checkpoints"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                bad(key, "must be a positive integer")
        for key in ("warmup", "log_interval", "eval_interval", "save_interval"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                bad(key, "must be an integer >= 0")
        if not 0 < self.lr:
            bad("lr", "must be > 0 (the peak learning rate, e.g. 3e-3)")
        if not 0 <= self.min_lr <= self.lr:
            bad("min_lr", f"need 0 <= min_lr <= lr={self.lr}")
        if self.schedule not in ("cosine", "wsd"):
            bad("schedule", "use 'cosine' or 'wsd'")
        if not 0 < self.decay_fraction <= 1:
            bad("decay_fraction", "must be in (0, 1]")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", "give two numbers in [0, 1), e.g. [0.9, 0.95]")
        if self.dtype not in ("auto", "bf16", "fp32"):
            bad("dtype", "use 'auto' (bf16 where the hardware runs it fast), 'bf16' (bf16 compute, fp32 master "
                         "weights) or 'fp32'")
        if self.recompute not in ("none", "full", "selective"):
            bad("recompute", "use 'none', 'full' or 'selective'")
        for key in ("weight_decay", "clip", "mtp_loss_scale", "aux_loss_coeff", "bias_update_speed", "peak_flops"):
            if getattr(self, key) < 0:
                bad(key, "must be >= 0")
        try:
            _, valid_share, _ = parse_split(self.split)
        except ValueError as e:
            bad("split", str(e))
        if valid_share == 0:
            bad("split", "the valid share is 0, but the held-out loss reads valid documents; give it a weight, "
                         "e.g. '969,30,1'")
        self.model_config()  # bad model overrides fail now, not after data loading
        self.parallel_config()  # likewise a bad layout (its fit to the world size is checked at launch)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The preset with `model` overrides; `vocab_size` (the tokenizer's) wins when given."""
        names = {f.name for f in dataclasses.fields(ModelConfig)} - {"extra"}
        unknown = sorted(set(self.model) - names)
        if unknown:
            raise ValueError(f"TrainConfig.model has unknown ModelConfig keys {unknown}; see seekforge/config.py")
        overrides = dict(self.model)
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return preset(self.preset, **overrides)

    def parallel_config(self) -> ParallelConfig:
        """The `parallel` table as a ParallelConfig; recompute and compile default to this config's."""
        return ParallelConfig.from_table({"recompute": self.recompute, "compile": self.compile, **self.parallel})


CONFIG_HELP = ("a config.json or a checkpoint directory holding one, a training run directory, or a pretrain config "
               "(YAML/TOML: its preset and model table)")


def model_config_of(source: str | Path) -> ModelConfig:
    """The model a config names (`seekforge info`, `seekforge plan`): a config.json or a checkpoint directory holding
    one; a pretrain config (YAML/TOML: its preset and model table); a training run directory (its HF export's config,
    else its train_config.yaml's model)."""
    path = Path(source)
    if path.suffix in (".yaml", ".yml", ".toml"):
        raw = read_config_file(path)
        return preset(raw.get("preset", TrainConfig.preset), **(raw.get("model") or {}))
    if path.is_dir() and not (path / "config.json").exists():
        for inside in (path / "hf" / "config.json", path / "train_config.yaml"):
            if inside.exists():
                return model_config_of(inside)
    return ModelConfig.from_hf(path)
