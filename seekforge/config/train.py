"""`TrainConfig`: one pretraining run, and `parse_split` for its train/valid/test shares."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from seekforge.config.model import PRESETS, ModelConfig, preset
from seekforge.config.parallel import ParallelConfig


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


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule: what train/optim.build_optimizer and lr_at read. Pretraining
    (TrainConfig.optimizer_config) and GRPO (GRPOConfig.optimizer_config) each say how they fill it."""

    lr: float
    min_lr: float
    warmup: int
    steps: int  # optimizer steps
    weight_decay: float
    betas: tuple[float, float]
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd only


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
    # Gradient accumulation (grad_accum >= 2) with each micro-batch's forward running beside the previous one's
    # backward, so one's expert all-to-all waits are spent on the other's compute (parallel/overlap.py); the
    # same gradients as without. Under pp: DualPipeV's overlapped forward/backward pairs, run at once.
    # Not with tp or cp > 1, FSDP bf16 parameters, or bf16 on one process.
    overlap: bool = False
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
            raise ValueError(f"TrainConfig.model has unknown ModelConfig keys {unknown}; see seekforge/config/model.py")
        overrides = dict(self.model)
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return preset(self.preset, **overrides)

    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(lr=self.lr, min_lr=self.min_lr, warmup=self.warmup, steps=self.steps,
                               weight_decay=self.weight_decay, betas=self.betas, schedule=self.schedule,
                               decay_fraction=self.decay_fraction)

    def parallel_config(self) -> ParallelConfig:
        """The `parallel` table as a ParallelConfig; recompute and compile default to this config's."""
        return ParallelConfig.from_table({"recompute": self.recompute, "compile": self.compile, **self.parallel})
