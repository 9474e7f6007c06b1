"""`seekforge pretrain`: train a DeepSeek-V3-architecture model from a config file and flags.

With no arguments it trains the built-in default: a small DeepSeek-V3 (MLA, 16-expert MoE, MTP) on
the built-in text corpus with the byte tokenizer, sized to learn visibly in a few minutes on two
CPU cores, writing runs/default/{metrics.jsonl, tensorboard/, loss.png, checkpoints/, hf/}.
Under torchrun the same command trains one model over all ranks:
    torchrun --nproc-per-node 8 -m seekforge.cli pretrain --parallel dp_shard=4,tp=2,ep=2
The run itself is train/pretrain.py; this module turns the command line into its TrainConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from seekforge.config import TrainConfig, parse_parallel
from seekforge.model.precision import auto_dtype_help
from seekforge.train.config_file import command_line, interrupt_hint_of, load_config

# Flags for the common fields: (flag, TrainConfig field, type). Everything else: --set key=value.
_FLAGS = [
    ("--data", "data", str, "builtin:text | builtin:arithmetic | Megatron prefix | blend 'w1 p1 w2 p2'"),
    ("--tokenizer", "tokenizer", str, "'byte' or a directory with tokenizer.json"),
    ("--steps", "steps", int, "optimizer steps"),
    ("--seq-len", "seq_len", int, "tokens per sample"),
    ("--micro-batch-size", "micro_batch_size", int, "samples per forward/backward"),
    ("--grad-accum", "grad_accum", int, "micro-batches per optimizer step"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--schedule", "schedule", str, "cosine | wsd (warmup-stable-decay)"),
    ("--dtype", "dtype", str,
     f"auto ({auto_dtype_help()}) | bf16 (bf16 weights over fp32 master weights) | fp32"),
    ("--recompute", "recompute", str, "activation recompute: none | full | selective"),
    ("--seed", "seed", int, "model init and data order"),
    ("--out-dir", "out_dir", str, "run directory"),
    ("--probe", "probe", str, "probe config YAML: module dumps, training monitor, metrics port (seekforge probe)"),
]
_DEFAULTS = TrainConfig()
# `seekforge pretrain` without --config or --preset: the `mini` preset (config/model.py says how it is sized),
# 300 steps of 8 × 256 tokens with a warmup-stable-decay schedule; its cost is ~9 TFLOP.
DEFAULT_RUN = dict(preset="mini", steps=300, schedule="wsd", lr=4e-3, min_lr=2e-4, warmup=20)


def on_interrupt(args) -> str:
    """What Ctrl-C says (seekforge/cli.py): how to go on."""
    return interrupt_hint_of(config_from_args(args))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Pretrain a DeepSeek-V3-architecture model. Settings come from TrainConfig defaults, then "
        "--config (YAML or TOML, keys = TrainConfig fields, a `model:` table overrides ModelConfig "
        "keys), then --preset and the flags below, then --set key=value (last wins). Without "
        "--config or --preset: the `mini` preset (hidden 192, 4 layers; MLA, 16 experts "
        "top-4, MTP), 300 steps on the built-in text corpus, under 5 minutes on 2 CPU cores. "
        "An existing run in --out-dir is resumed from its latest checkpoint (--no-resume to restart)."
    )
    # Flags default to SUPPRESS so that only what the user typed overrides the config file.
    p.add_argument("--config", default=argparse.SUPPRESS, help="YAML or TOML file of TrainConfig fields")
    p.add_argument("--preset", default=argparse.SUPPRESS,
                   help=f"model preset: tiny | mini | small | v2-lite | v3-671b (default: {DEFAULT_RUN['preset']}; "
                        f"{_DEFAULTS.preset} with --config)")
    p.add_argument("--name", default=argparse.SUPPRESS, help="run name: same as --out-dir runs/NAME")
    for flag, field, kind, text in _FLAGS:
        default = getattr(_DEFAULTS, field)
        plain = DEFAULT_RUN.get(field, default)  # the run without --config or --preset
        p.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS,
                       help=f"{text} (default: {plain}" + (f"; {default} with --config or --preset)"
                                                            if plain != default else ")"))
    p.add_argument("--parallel", default=argparse.SUPPRESS, metavar="KEY=VALUE,...",
                   help="layout under torchrun: ParallelConfig keys, e.g. dp_shard=2,tp=2,ep=2 (world size = "
                        "pp·dp_replicate·dp_shard·cp·tp); default under torchrun: dp_shard=WORLD_SIZE")
    p.add_argument("--compile", action="store_true", default=argparse.SUPPRESS,
                   help="torch.compile each block (default: off)")
    p.add_argument("--no-resume", dest="resume", action="store_false", default=argparse.SUPPRESS,
                   help="start fresh even if OUT_DIR holds checkpoints (they are overwritten)")
    p.add_argument("--no-checkpoint-fallback", dest="checkpoint_fallback", action="store_false",
                   default=argparse.SUPPRESS, help="a damaged latest checkpoint is an error, not a fallback to "
                                                   "the newest intact older one")
    p.add_argument("--dry-run", action="store_true", default=False,
                   help="print the --parallel layout's parameter bytes per rank and build this model on the meta "
                        "device, parallelized under a fake process group of that many ranks; allocate nothing, "
                        "train nothing (any size: --preset v3-671b "
                        "--parallel pp=8,dp_shard=128,ep=64,tp=2,microbatches=8)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any TrainConfig field, e.g. --set warmup=50 --set model.num_hidden_layers=4; "
                        "fields are listed in seekforge/config/train.py (TrainConfig)")


def config_from_args(args) -> TrainConfig:
    given = vars(args)
    path, updates, overrides = command_line(args, [f[1] for f in _FLAGS] + ["compile", "resume",
                                                                              "checkpoint_fallback", "preset"])
    if "name" in given:
        updates["out_dir"] = str(Path("runs") / given["name"])
    if "config" not in given and "preset" not in given:  # the default run
        updates = {**DEFAULT_RUN, **updates}
    if "parallel" in given:
        updates["parallel"] = parse_parallel(given["parallel"])
    cfg = load_config(TrainConfig, path, updates, overrides)  # tables (model, parallel) merge key by key
    named_by = f"--preset {given['preset']}" if "preset" in given else f"--config {path}" if path else None
    if named_by and cfg.resume and not given.get("dry_run"):  # resuming another model would train that one
        from seekforge.train.checkpoint import check_resumed_model

        check_resumed_model(cfg.out_dir, cfg.model_config(), named_by)
    return cfg


def run(args) -> None:
    if getattr(args, "dry_run", False):
        from seekforge.parallel.materialize import dry_run
        from seekforge.train.pretrain import run_model

        cfg = config_from_args(args)
        # The model the run would train, with the tokenizer's vocab: the one a --preset or --config names (a run
        # would refuse a directory holding another), else the run to resume's own.
        named = "preset" in vars(args) or "config" in vars(args)
        model_cfg, _, _ = run_model(dataclasses.replace(cfg, resume=False) if named else cfg)
        print(dry_run(model_cfg, cfg.parallel_config()))
        return
    from seekforge.train.pretrain import pretrain  # torch.distributed, data and model: only when it runs

    pretrain(config_from_args(args))
