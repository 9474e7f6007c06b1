"""GRPOConfig: one GRPO run, checked in full before any model is built.

YAML/TOML files map 1:1 onto the fields (train/config_file.load_config, pretrain's loader too); a
`model:` table overrides the built-in base model's ModelConfig keys (used only when `base` is empty
and the run prepares its own base checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seekforge.config import OptimizerConfig
from seekforge.parallel.recompute import MODES as RECOMPUTE_MODES
from seekforge.rl.algorithm import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS, scale_rewards_mode
from seekforge.rl.data import BUILTIN, check_data_spec
from seekforge.rl.rewards import ON_ERROR, resolve_reward
from seekforge.train.config_file import load_config

# The built-in base: a small dense-then-MoE DeepSeek-V3 (MLA, 8 experts top-2, no MTP) that learns
# two-digit addition and subtraction to a middling accuracy in a few minutes on two CPU cores.
DEFAULT_BASE_MODEL = dict(hidden_size=128, num_hidden_layers=3, intermediate_size=384, moe_intermediate_size=64,
                          num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                          qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                          n_group=2, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=0,
                          max_position_embeddings=256)


@dataclass
class GRPOConfig:
    base: str = ""  # HF checkpoint directory of the starting policy; "": prepare the built-in base
    tokenizer: str = "byte"  # used with the built-in base; a given base brings its own
    # The prompts (rl/data.py): builtin:arithmetic, a .jsonl / .parquet file, a datasets.save_to_disk directory
    # (DIR[:SPLIT]) or hf:NAME[:CONFIG]:SPLIT, with a `prompt` column (text or chat messages) and other columns
    # that reach the rewards; its held-out prompts (eval_data's, or eval_prompts of its rows) are graded by rewards[0].
    data: str = "builtin:arithmetic"
    # builtin:arithmetic: the ArithmeticTask levels of the prompts. Level 1 (20,000 questions) over level 2
    # (~950, so RL prompts repeat what the base memorized): +8 vs +5 held-out points from a 30%-36% base
    # (git log -p BENCHMARKS.md)
    task_levels: list[int] = field(default_factory=lambda: [1])
    # built-in names (arithmetic, format, boxed, length), module:function or path/to/file.py:function (rl/rewards.py)
    rewards: list[str] = field(default_factory=lambda: ["arithmetic"])
    reward_weights: list[float] = field(default_factory=lambda: [1.0])
    steps: int = 300  # rollout iterations
    # 64 prompts: on the built-in base, 16 per step left the Adam updates too noisy to help
    prompts_per_step: int = 64
    group_size: int = 8  # G completions per prompt
    max_new_tokens: int = 8
    # The loss (rl/algorithm.py). Names and values are TRL 1.16 GRPOConfig's (epsilon → clip_low, epsilon_high →
    # clip_high, num_iterations → mu): a TRL run's settings give TRL's gradients (tests/rl/test_trl_end_to_end.py).
    temperature: float = 1.0  # sampling temperature; training log-probs are of logits / temperature, as TRL's
    mu: int = 1  # optimizer steps per rollout batch (old log-probs stored when > 1)
    loss_type: str = "dapo"  # grpo | bnpo | dapo | dr_grpo | cispo | sapo (rl/algorithm.surrogate, sequence_weights)
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher; cispo: the cap of the ratio itself (ε_max; ScaleRL uses 5.0)
    beta: float = 0.0  # KL-to-reference coefficient (k3); 0 builds no reference model
    # "group": advantages divided by the group's reward std | "batch": by the whole batch's (PPO Lite) | "none":
    # not divided (Dr. GRPO). true / false (this field's old values, and TRL's) mean "group" / "none".
    scale_rewards: str = field(default="group", metadata={"also_bool": True})
    # k3 times the ratio π/π_old (DeepSeek-V3.2's correction: the unbiased reverse-KL gradient). False, seekforge's
    # default: the plain k3 of DeepSeekMath's GRPO, which runs with beta > 0 were trained with, so their results and
    # resumes stay as they were (beta = 0 by default, so neither matters then). TRL 1.16 defaults to true: set it
    # true to get a TRL run's numbers.
    use_bias_correction_kl: bool = False
    importance_sampling_level: str = "token"  # "sequence": GSPO, one ratio per sequence (its mean log-ratio)
    delta: float | None = None  # two-sided clipping (INTELLECT-2): the ratio also capped at delta; null: off
    sapo_temperature_pos: float = 1.0  # loss_type sapo: the gate's temperature for positive advantages
    sapo_temperature_neg: float = 1.05  # ... and for the others
    mask_truncated_completions: bool = False  # completions cut at max_new_tokens stay out of the loss (DAPO)
    # keep in the policy term only the tokens at or above this entropy quantile of their micro-batch (0.2 in the
    # paper, arXiv:2506.01939); 1: all. < 1 costs a forward without a graph per optimizer step.
    top_entropy_quantile: float = 1.0
    # TRL's micro-batch (per_device_train_batch_size sequences, consecutive in the step's group-major order): what
    # bnpo normalizes by and top_entropy_quantile ranks within. 0: the whole step (bnpo = dapo). It changes no
    # computation's layout: training rows are packed whatever it is.
    micro_batch_size: int = 0
    lr: float = 1e-4
    warmup: int = 0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    # rows of up to 2048 tokens: fewer, larger matmuls per expert and fewer per-row passes. grpo_step's bf16
    # training phase was faster than at 1024 or 512 and no slower than at 4096; fp32 on AVX2 did not care
    # (benchmarks/grpo_step.py; the A/B is in git log -p BENCHMARKS.md)
    max_pack_tokens: int = 2048
    max_pack_count: int = 64
    swap: bool = True  # free the engine's KV pool during training; offload reference / optimizer state
    fsdp: bool = True  # under torchrun: FSDP-shard the policy and its optimizer state (False: full replicas)
    # auto (model/precision.resolve_dtype for batched work: on CPUs fp32 below hidden 512) | bf16 | fp32,
    # for training and rollouts alike
    dtype: str = "auto"
    kv_cache_memory: str = "64MiB"
    compile: bool = False  # rollouts' decode steps as compiled programs (serve/compiled.py; compiled when built)
    # activation recompute of the policy's blocks in training (parallel/recompute.py: none | selective | full), as
    # TRL's gradient_checkpointing: less memory for the training pass, the same gradients
    recompute: str = "none"
    eval_prompts: int = 500  # held-out prompts, greedy; 0 disables (500: ±2 points of binomial noise at 30%)
    eval_interval: int = 25
    # --- a user's data and rewards, the held-out evaluation and the samples file (rl/data.py, rl/rewards.py,
    # rl/evaluate.py, rl/score.py)
    eval_data: str = ""  # held-out prompts of their own, in any form `data` takes; "": eval_prompts of data's rows
    # a reward that raises or returns the wrong number of values: raise (the run stops, its state at the last
    # completed step saved, so a fixed reward resumes it) | zero (those samples score 0; counted in reward_errors)
    reward_errors: str = "raise"
    eval_k: int = 0  # pass@k at each evaluation: k completions per held-out prompt at `temperature`; 0: greedy only
    eval_pass_score: float = 1.0  # a held-out completion passes when the grading reward (rewards[0]) reaches this
    sample_interval: int = 25  # every N steps each completion (prompt, text, rewards) → out_dir/samples.jsonl; 0: off
    seed: int = 0
    out_dir: str = "runs/grpo"
    save_interval: int = 20  # 0: save only at the end
    keep_checkpoints: int = 2
    probe: str = ""  # probe config YAML (monitor, dumps, metrics port; seekforge/probe/config.py); "": timing only
    resume: bool = True
    checkpoint_fallback: bool = True  # a damaged latest checkpoint: resume from an older intact one (TrainConfig's)
    # preparing the built-in base (when `base` is empty)
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides of DEFAULT_BASE_MODEL
    base_steps: int = 4000  # at most; it stops early at base_target_accuracy or a plateau (rl/base.py)
    # 1e-3: the base learned the units digit within ~1,200-3,600 steps in each of nine runs; at 3e-3 the
    # clean corpus was at 31% after 2,500 steps and the slip corpus at 11% after 3,000 (git log -p BENCHMARKS.md)
    base_lr: float = 1e-3
    base_check_interval: int = 100
    base_target_accuracy: float = 0.5
    base_patience: int = 4  # checks without a better held-out accuracy that end the base's pretraining; 0: off
    # The base's corpus imitates one with mistakes: this share of the carried (borrowed) answers drop the
    # carry (data/corpora.dropped_carry), so a base that has learned the task knows both ways and greedily
    # answers most carried questions with the slip: GRPO's reward has a wrong preference to fix, which it
    # does in 100-200 steps. 0: a clean corpus (the base is then still learning the task when it stops, and
    # GRPO moves it by a few points only).
    base_slip_share: float = 2 / 3

    def __post_init__(self):
        self.validate()

    def optimizer_config(self) -> OptimizerConfig:
        """Linear warmup, then constant (cosine down to min_lr = lr); μ optimizer steps per GRPO step."""
        return OptimizerConfig(lr=self.lr, min_lr=self.lr, warmup=self.warmup, steps=self.steps * self.mu,
                               weight_decay=self.weight_decay, betas=(0.9, 0.99))

    def _validate_loss(self, bad) -> None:
        """The loss's fields (TRL's rules); scale_rewards's bools become their names here."""
        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", f"choose one of {LOSS_TYPES}")
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = scale_rewards_mode(self.scale_rewards)
        if self.scale_rewards not in SCALE_REWARDS:
            bad("scale_rewards", f"choose one of {SCALE_REWARDS} (true / false: group / none)")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            bad("importance_sampling_level", f"choose one of {IMPORTANCE_SAMPLING_LEVELS}")
        if self.loss_type == "cispo" and self.clip_high < 1:
            bad("clip_high", "cispo caps the ratio itself at clip_high (TRL's epsilon_high, ε_max): give the cap, "
                             "e.g. clip_high=5.0 as ScaleRL does; below 1 it would shrink every token's weight")
        if isinstance(self.delta, str):  # YAML 1.1 reads 1e0 as a string, as GRPOConfig's float fields allow
            self.delta = float(self.delta) if _parses_as_number(self.delta) else self.delta
        if self.delta is not None and (not _is_number(self.delta) or self.delta <= 1):
            bad("delta", "the two-sided clip's cap of the ratio: a number > 1 (TRL recommends > 1 + clip_high, "
                         "INTELLECT-2 uses 4), or null: off")
        if self.delta is not None:
            self.delta = float(self.delta)
        for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, key) <= 0:
                bad(key, "must be > 0")
        if not 0 <= self.top_entropy_quantile <= 1:
            bad("top_entropy_quantile", "must be in [0, 1] (1: every token)")
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 0:
            bad("micro_batch_size", "must be an integer >= 0 (0: the whole step is one micro-batch)")
        if self.micro_batch_size and (self.prompts_per_step * self.group_size) % self.micro_batch_size:
            bad("micro_batch_size", f"must divide the step's {self.prompts_per_step * self.group_size} sequences "
                                    "(prompts_per_step x group_size)")

    def validate(self) -> None:
        def bad(key, msg):
            raise ValueError(f"GRPOConfig.{key}={getattr(self, key)!r}: {msg}")

        if not isinstance(self.group_size, int) or self.group_size < 2:
            bad("group_size", "must be an integer >= 2: advantages compare completions within a group")
        for key in ("steps", "prompts_per_step", "max_new_tokens", "mu", "max_pack_tokens", "max_pack_count",
                    "keep_checkpoints", "base_steps",
                    "base_check_interval"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                bad(key, "must be a positive integer")
        for key in ("warmup", "eval_prompts", "eval_interval", "save_interval", "base_patience"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                bad(key, "must be an integer >= 0")
        for key in ("clip_low", "clip_high", "beta", "weight_decay", "clip_grad"):
            if getattr(self, key) < 0:
                bad(key, "must be >= 0")
        if self.clip_low >= 1:
            bad("clip_low", "must be < 1 (the ratio's lower bound is 1 - clip_low)")
        if not 0 <= self.base_slip_share <= 1:
            bad("base_slip_share", "must be in [0, 1]")
        if not 0 < self.base_target_accuracy <= 1:
            bad("base_target_accuracy", "must be in (0, 1]")
        if self.temperature <= 0:
            bad("temperature", "must be > 0: GRPO needs different completions within a group")
        if self.lr <= 0 or self.base_lr <= 0:
            bad("lr", "lr and base_lr must be > 0")
        if self.dtype not in ("auto", "bf16", "fp32"):
            bad("dtype", "choose auto, bf16 or fp32")
        if self.recompute not in RECOMPUTE_MODES:
            bad("recompute", f"choose one of {', '.join(RECOMPUTE_MODES)}")
        self._validate_loss(bad)
        if not set(self.task_levels) <= {1, 2, 3} or not self.task_levels:
            bad("task_levels", "pick a non-empty subset of [1, 2, 3]")
        if not all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w)
                   for w in self.reward_weights):
            bad("reward_weights", f"give numbers, one per reward (got {self.reward_weights})")
        if len(self.reward_weights) != len(self.rewards) or not self.rewards:
            bad("reward_weights", f"give one weight per reward ({len(self.rewards)} rewards: {self.rewards})")
        self._validate_data_and_rewards(bad)

    def _validate_data_and_rewards(self, bad) -> None:
        for spec in self.rewards:
            resolve_reward(spec)  # an unknown name fails here, before anything is built
        check_data_spec(self.data)
        if self.eval_data:
            if self.data == BUILTIN:
                bad("eval_data", f"needs data other than {BUILTIN!r}, which holds out questions of its own")
            check_data_spec(self.eval_data, "eval_data")
        if self.reward_errors not in ON_ERROR:
            bad("reward_errors", f"choose one of {ON_ERROR}")
        for key in ("eval_k", "sample_interval"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                bad(key, "must be an integer >= 0")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parses_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load_grpo_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> GRPOConfig:
    """Defaults ← file (YAML/TOML) ← overrides ("key=value" strings or a dict)."""
    return load_config(GRPOConfig, path, overrides)
