"""`seekforge pretrain`: train a DeepSeek-V3-architecture model from a config file and flags.

With no arguments it trains the built-in default: a small DeepSeek-V3 (MLA, 16-expert MoE, MTP) on
the built-in text corpus with the byte tokenizer, sized to learn visibly in a few minutes on two
CPU cores, writing runs/default/{metrics.jsonl, tensorboard/, loss.png, checkpoints/, hf/}.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import torch
import yaml

from seekforge.config import ModelConfig, TrainConfig
from seekforge.train.config_file import load_train_config, parse_overrides, train_config_to_dict

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
    ("--dtype", "dtype", str, "bf16 (autocast, fp32 master weights) | fp32"),
    ("--recompute", "recompute", str, "activation recompute: none | full | selective"),
    ("--seed", "seed", int, "model init and data order"),
    ("--out-dir", "out_dir", str, "run directory"),
]
_DEFAULTS = TrainConfig()
# `seekforge pretrain` without --config or --preset: the `small` preset shrunk to hidden 256 and 4
# layers (still MLA, 16 experts top-4 in 4 groups, MTP), which learns visibly in a few minutes on 2
# CPU cores where the full `small` (45M parameters) would only start to.
DEFAULT_RUN_MODEL = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, moe_intermediate_size=128,
                         num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Pretrain a DeepSeek-V3-architecture model. Settings come from TrainConfig defaults, then "
        "--config (YAML or TOML, keys = TrainConfig fields, a `model:` table overrides ModelConfig "
        "keys), then --preset and the flags below, then --set key=value (last wins). Without "
        "--config or --preset: the `small` preset shrunk to hidden 256 / 4 layers (MLA, 16 experts "
        "top-4, MTP) on the built-in text corpus, a few minutes on 2 CPU cores. "
        "An existing run in --out-dir is resumed from its latest checkpoint (--no-resume to restart)."
    )
    # Flags default to SUPPRESS so that only what the user typed overrides the config file.
    p.add_argument("--config", default=argparse.SUPPRESS, help="YAML or TOML file of TrainConfig fields")
    p.add_argument("--preset", default=argparse.SUPPRESS,
                   help=f"model preset: tiny | small | v2-lite | v3-671b (default: {_DEFAULTS.preset})")
    p.add_argument("--name", default=argparse.SUPPRESS, help="run name: same as --out-dir runs/NAME")
    for flag, field, kind, text in _FLAGS:
        p.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS,
                       help=f"{text} (default: {getattr(_DEFAULTS, field)})")
    p.add_argument("--compile", action="store_true", default=argparse.SUPPRESS,
                   help="torch.compile each block (default: off)")
    p.add_argument("--no-resume", dest="resume", action="store_false", default=argparse.SUPPRESS,
                   help="start fresh even if OUT_DIR holds checkpoints (they are overwritten)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any TrainConfig field, e.g. --set warmup=50 --set model.num_hidden_layers=4; "
                        "fields are listed in seekforge/config.py (TrainConfig)")


def config_from_args(args) -> TrainConfig:
    given = vars(args)
    updates = {field: given[field] for field in [f[1] for f in _FLAGS] + ["compile", "resume", "preset"]
               if field in given}
    if "name" in given:
        updates["out_dir"] = str(Path("runs") / given["name"])
    if "config" not in given and "preset" not in given:
        updates["model"] = dict(DEFAULT_RUN_MODEL)
    overrides = parse_overrides(given.get("overrides", []))
    if "model" in updates and "model" in overrides:
        overrides["model"] = {**updates["model"], **overrides["model"]}
    return load_train_config(given.get("config"), {**updates, **overrides})


def resolve_model_config(cfg: TrainConfig, tokenizer_vocab: int) -> ModelConfig:
    """The preset (+ model overrides) with vocab_size = the tokenizer's, rounded up to a multiple
    of 64 (aligned matmul shapes; the extra rows are never targets). An explicit
    model.vocab_size wins; resuming a run uses the config stored in its checkpoint instead."""
    if "vocab_size" in cfg.model:
        return cfg.model_config()
    return cfg.model_config(vocab_size=64 * math.ceil(tokenizer_vocab / 64))


def build_data(cfg: TrainConfig, tokenizer):
    """Training loader, fixed eval batches and the unigram-entropy baseline (nats/token)."""
    from seekforge.data.dataset import BatchLoader, build_dataset
    from seekforge.data.corpora import unigram_entropy

    samples_per_step = cfg.micro_batch_size * cfg.grad_accum
    train_set = build_dataset(cfg.data, tokenizer, cfg.seq_len, cfg.seed, cfg.steps * samples_per_step)
    loader = BatchLoader(train_set, cfg.micro_batch_size, cfg.seed)
    # A different seed draws different samples for the built-in corpora; for a fixed corpus it is a
    # different shuffle, i.e. not strictly held out.
    eval_set = build_dataset(cfg.data, tokenizer, cfg.seq_len, cfg.seed + 1, cfg.eval_batches * cfg.micro_batch_size)
    eval_loader = BatchLoader(eval_set, cfg.micro_batch_size, cfg.seed + 1)
    eval_iter = iter(eval_loader)
    eval_batches = [next(eval_iter) for _ in range(cfg.eval_batches)]
    # The baseline from up to ~128k training targets, read through a separate loader so the
    # training loader's position is untouched. unigram_entropy is in nats, like the loss.
    probe = iter(BatchLoader(train_set, cfg.micro_batch_size, cfg.seed))
    num_batches = max(1, min(len(train_set) // cfg.micro_batch_size, 131072 // (cfg.micro_batch_size * cfg.seq_len)))
    targets = torch.cat([next(probe)["labels"].reshape(-1) for _ in range(num_batches)])
    baseline = float(unigram_entropy(targets[targets >= 0]))
    return loader, eval_batches, baseline


def run(args) -> None:
    from seekforge.model.model import build_model
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.train.checkpoint import latest_checkpoint
    from seekforge.train.trainer import Trainer, prepare_model

    cfg = config_from_args(args)
    out_dir = Path(cfg.out_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
    model_cfg = resolve_model_config(cfg, tokenizer.vocab_size)
    latest = latest_checkpoint(out_dir / "checkpoints") if cfg.resume else None
    if latest is not None and (latest / "config.json").exists():
        model_cfg = ModelConfig.from_hf(latest)
    loader, eval_batches, baseline = build_data(cfg, tokenizer)

    model = build_model(model_cfg, device, torch.float32, seed=cfg.seed)  # fp32 master weights
    prepare_model(model, cfg)
    trainer = Trainer(cfg, model, loader, eval_batches, out_dir, baseline=baseline)
    if latest is not None:
        trainer.resume(latest)
    else:  # a fresh start: an old run's curve and checkpoints in the same directory would mix in
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_config.yaml").write_text(yaml.safe_dump(train_config_to_dict(cfg), sort_keys=False))

    counts = model_cfg.num_params()
    print(f"seekforge pretrain → {out_dir}")
    print(f"model: preset {cfg.preset}, {counts['total'] / 1e6:.1f}M params ({counts['active'] / 1e6:.1f}M "
          f"activated, +{counts['mtp'] / 1e6:.1f}M MTP), vocab {model_cfg.vocab_size}, {model_cfg.num_hidden_layers} "
          f"layers, {model_cfg.n_routed_experts} experts top-{model_cfg.num_experts_per_tok}")
    print(f"data: {cfg.data}, {trainer.tokens_per_step:,} tokens/step × {cfg.steps} steps; "
          f"{cfg.dtype} on {device}; {trainer.flops_per_token / 1e6:.1f} MFLOP/token, "
          f"peak {trainer.peak_flops / 1e9:.0f} GFLOP/s ({'measured' if not cfg.peak_flops else 'given'})")
    print(f"unigram-entropy baseline: {baseline:.3f} nats/token (the best loss without context)")
    if latest is not None:
        print(f"resumed from {latest} at step {trainer.step}")

    start = time.perf_counter()
    history = trainer.fit()
    elapsed = time.perf_counter() - start
    if history:
        last = history[-1]
        print(f"done: {len(history)} steps in {elapsed:.0f}s; final lm loss {last['lm_loss']:.3f}, "
              f"eval loss {last.get('eval_loss', float('nan')):.3f} vs unigram entropy {baseline:.3f} nats/token")
    else:
        print(f"nothing to train: {out_dir} already holds step {trainer.step}/{cfg.steps} (--no-resume restarts)")
    print(f"metrics: {out_dir / 'metrics.jsonl'}, tensorboard: {out_dir / 'tensorboard'}, plot: {out_dir / 'loss.png'}")

    sample_model = None
    if cfg.export_hf:
        from seekforge.generate import load_model

        hf_dir = export_hf(model, tokenizer, cfg, out_dir / "hf")
        sample_model, _ = load_model(str(hf_dir))  # sampling from the export also proves it loads
    if cfg.sample_prompt:
        if sample_model is None:
            sample_model = plain_copy(model, model_cfg)
        print_sample(sample_model, tokenizer, cfg.sample_prompt)


def export_hf(model, tokenizer, cfg: TrainConfig, hf_dir: Path) -> Path:
    from seekforge.model.hf import save_hf

    save_hf(model, hf_dir)
    if cfg.tokenizer != "byte":  # the byte tokenizer needs no files; load_model falls back to it
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(cfg.tokenizer) / name).exists():
                shutil.copy(Path(cfg.tokenizer) / name, hf_dir / name)
    print(f"HF checkpoint: {hf_dir} (load with transformers or `seekforge generate --model {hf_dir}`)")
    return hf_dir


def plain_copy(model, model_cfg: ModelConfig):
    """The trained weights in an unwrapped, uncompiled Transformer (generation uses KV caches)."""
    from seekforge.model.model import Transformer

    plain = Transformer(model_cfg)
    plain.load_state_dict(model.state_dict())  # recompute-wrapper hooks strip their prefixes
    return plain.eval()


def print_sample(model, tokenizer, prompt: str) -> None:
    from seekforge.generate import generate

    ids = tokenizer.encode(prompt)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    # Greedy decoding of a minutes-old model loops on its most frequent words; a seeded,
    # temperature-0.8 top-40 sample shows better what it learned, and is reproducible.
    new = generate(model, ids, max_new_tokens=160, temperature=0.8, top_k=40, seed=0, stop_token_ids=stop)
    print(f"sample (temperature 0.8, top-k 40): {prompt!r} → {tokenizer.decode(new)!r}")
