"""`ModelConfig`: exactly the keys of a DeepSeek-V3 Hugging Face `config.json`, so a real checkpoint's
config loads unchanged (`ModelConfig.from_hf`); keys seekforge does not know are kept in `extra` and
written back on save, never interpreted. `PRESETS` are the named models (`preset`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seekforge.config import sizes


@dataclass
class ModelConfig:
    vocab_size: int = 129280  # V (the shape legend of model/model.py)
    hidden_size: int = 7168  # H
    intermediate_size: int = 18432  # a dense layer's SwiGLU width
    moe_intermediate_size: int = 2048  # one expert's SwiGLU width
    num_hidden_layers: int = 61
    num_attention_heads: int = 128  # nh
    num_key_value_heads: int = 128  # MLA ignores it; kept for HF round trips
    q_lora_rank: int | None = 1536  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512  # r: the width of the latent c_kv that the KV cache stores
    qk_nope_head_dim: int = 128  # dn
    qk_rope_head_dim: int = 64  # dr: the rotated part of q and of the one k_pe all heads share
    v_head_dim: int = 128  # dv
    n_routed_experts: int = 256  # 0: every layer dense
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8  # routed experts per token, chosen within topk_group of the n_group groups
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5  # on the routed experts' weighted sum
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str = "noaux_tc"  # "noaux_tc" (V3), "greedy" / "group_limited_greedy" (V2)
    first_k_dense_replace: int = 3  # layers 0..k-1 dense, then every moe_layer_freq-th layer MoE
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 1  # MTP depth (DeepSeek-V3 §2.2)
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
        """Exact parameter counts, from the config alone: "total", "active" (per token) and "mtp" (config/sizes.py)."""
        return sizes.num_params(self)


def rope_type(rope: dict) -> str:
    """The kind of a rope_scaling / rope_parameters dict: "rope_type" in newer
    transformers, "type" in DeepSeek's own config.json."""
    return rope.get("rope_type", rope.get("type", "default"))


_V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: every feature on (q low-rank, groups, dense + MoE layers, MTP), < 2M parameters.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                 n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                 first_k_dense_replace=1, num_nextn_predict_layers=1, max_position_embeddings=512),
    # Benchmarks: ~45M parameters, 16 experts, top-4.
    "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
                  num_hidden_layers=6, num_attention_heads=8, q_lora_rank=192, kv_lora_rank=128,
                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
                  n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                  first_k_dense_replace=1, num_nextn_predict_layers=1, max_position_embeddings=2048),
    # `seekforge pretrain` with no --config or --preset: `small` narrowed to hidden 192 and 4 layers (still MLA,
    # 16 experts top-4 in 4 groups, MTP), ~3.6M parameters. Sized for the slower of the CPUs users have: a
    # 2-core AVX2 machine trains in fp32 at ~70 GFLOP/s peak, so its 300-step default run must cost < ~10 TFLOP to
    # end within 5 minutes.
    "mini": dict(vocab_size=4096, hidden_size=192, intermediate_size=576, moe_intermediate_size=96,
                 num_hidden_layers=4, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
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


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
