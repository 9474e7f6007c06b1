"""`seekforge pretrain`: train a DeepSeek-V3-architecture model from a config file and flags.

With no arguments it trains the built-in default: a small DeepSeek-V3 (MLA, 16-expert MoE, MTP) on
the built-in text corpus with the byte tokenizer, sized to learn visibly in a few minutes on two
CPU cores, writing runs/default/{metrics.jsonl, tensorboard/, loss.png, checkpoints/, hf/}.

Under torchrun the same command trains one model over all ranks:
    torchrun --nproc-per-node 8 -m seekforge.cli pretrain --parallel dp_shard=2,tp=2,ep=2,...
Every rank builds the model from the same seed, `parallel/parallelize` lays it out, and each
data-parallel rank trains on its slice of the same global batch (micro_batch_size is global), so
the losses are the single-device run's. Rank 0 alone prints, logs and exports.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from seekforge.config import ModelConfig, ParallelConfig, TrainConfig
from seekforge.train.config_file import load_train_config, parse_overrides, parse_parallel, train_config_to_dict

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
    ("--probe", "probe", str, "probe config YAML: module dumps, training monitor, metrics port (seekforge probe)"),
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
    p.add_argument("--parallel", default=argparse.SUPPRESS, metavar="KEY=VALUE,...",
                   help="layout under torchrun: ParallelConfig keys, e.g. dp_shard=2,tp=2,ep=2 (world size = "
                        "pp·dp_replicate·dp_shard·tp); default under torchrun: dp_shard=WORLD_SIZE")
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
    if "parallel" in given:
        updates["parallel"] = parse_parallel(given["parallel"])
    overrides = parse_overrides(given.get("overrides", []))
    for table in ("model", "parallel"):
        if table in updates and table in overrides:
            overrides[table] = {**updates[table], **overrides[table]}
    return load_train_config(given.get("config"), {**updates, **overrides})


def resolve_model_config(cfg: TrainConfig, tokenizer_vocab: int) -> ModelConfig:
    """The preset (+ model overrides) with vocab_size = the tokenizer's, rounded up to a multiple
    of 64 (aligned matmul shapes; the extra rows are never targets). An explicit
    model.vocab_size wins; resuming a run uses the config stored in its checkpoint instead."""
    if "vocab_size" in cfg.model:
        return cfg.model_config()
    return cfg.model_config(vocab_size=64 * math.ceil(tokenizer_vocab / 64))


def build_data(cfg: TrainConfig, tokenizer, dp_rank: int = 0, dp_size: int = 1):
    """Training loader, fixed eval batches and the unigram-entropy baseline (nats/token); the
    loader and eval batches hold data-parallel rank `dp_rank`'s rows of each global batch."""
    from seekforge.data.corpora import unigram_entropy
    from seekforge.data.dataset import BatchLoader, build_dataset

    samples_per_step = cfg.micro_batch_size * cfg.grad_accum
    train_set = build_dataset(cfg.data, tokenizer, cfg.seq_len, cfg.seed, cfg.steps * samples_per_step)
    loader = BatchLoader(train_set, cfg.micro_batch_size, cfg.seed, dp_rank, dp_size)
    # A different seed draws different samples for the built-in corpora; for a fixed corpus it is a
    # different shuffle, i.e. not strictly held out.
    eval_set = build_dataset(cfg.data, tokenizer, cfg.seq_len, cfg.seed + 1, cfg.eval_batches * cfg.micro_batch_size)
    eval_loader = BatchLoader(eval_set, cfg.micro_batch_size, cfg.seed + 1, dp_rank, dp_size)
    eval_iter = iter(eval_loader)
    eval_batches = [next(eval_iter) for _ in range(cfg.eval_batches)]
    # The baseline from up to ~128k training targets, read through a separate loader so the
    # training loader's position is untouched. unigram_entropy is in nats, like the loss.
    probe = iter(BatchLoader(train_set, cfg.micro_batch_size, cfg.seed))
    num_batches = max(1, min(len(train_set) // cfg.micro_batch_size, 131072 // (cfg.micro_batch_size * cfg.seq_len)))
    targets = torch.cat([next(probe)["labels"].reshape(-1) for _ in range(num_batches)])
    baseline = float(unigram_entropy(targets[targets >= 0]))
    return loader, eval_batches, baseline


def parallel_layout(cfg: TrainConfig, model_cfg: ModelConfig, world_size: int) -> ParallelConfig | None:
    """The layout of a torchrun job (None for one plain process), checked before any process group or
    tensor exists so that a bad one fails at once with one message."""
    if world_size == 1 and not cfg.parallel:
        return None
    pc = cfg.parallel_config() if cfg.parallel else ParallelConfig(dp_shard=world_size, recompute=cfg.recompute,
                                                                  compile=cfg.compile)
    if world_size == 1 and "WORLD_SIZE" not in os.environ:  # a plain process, not started by torchrun
        if pc.world_size > 1:
            raise ValueError(f"--parallel asks for {pc.world_size} ranks but this is a single process; launch "
                             f"with torchrun --nproc-per-node {pc.world_size} -m seekforge.cli pretrain ...")
        return None
    pc.validate(world_size, model_cfg)
    dp = pc.dp_replicate * pc.dp_shard
    if cfg.micro_batch_size % dp:
        raise ValueError(f"micro_batch_size={cfg.micro_batch_size} (the global batch) does not split over "
                         f"dp_replicate*dp_shard={dp} data-parallel ranks; make it a multiple of {dp}")
    if pc.pp > 1:  # what the pipeline stages' loss (parallel/pp.StageModule.loss) does not cover
        if (cfg.micro_batch_size // dp) % pc.microbatches:
            raise ValueError(f"each data-parallel rank's {cfg.micro_batch_size // dp} samples do not split into "
                             f"microbatches={pc.microbatches}; make micro_batch_size a multiple of "
                             f"{dp * pc.microbatches}")
        if cfg.aux_loss_coeff > 0:
            raise ValueError(f"aux_loss_coeff={cfg.aux_loss_coeff} with pp={pc.pp}: the sequence-wise balance loss "
                             "is not added across pipeline stages; set --set aux_loss_coeff=0 (the aux-loss-free "
                             "bias still balances the experts)")
        if cfg.dtype != "fp32" or cfg.grad_accum != 1:
            raise ValueError(f"dtype={cfg.dtype}, grad_accum={cfg.grad_accum} with pp={pc.pp}: use --dtype fp32 "
                             "(bf16 compute: parallel mixed_precision=bf16) and grad_accum=1 (more microbatches "
                             "instead)")
    return pc


def run(args) -> None:
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.parallel.mesh import init_distributed
    from seekforge.train.checkpoint import latest_checkpoint

    cfg = config_from_args(args)
    out_dir = Path(cfg.out_dir)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
    model_cfg = resolve_model_config(cfg, tokenizer.vocab_size)
    latest = latest_checkpoint(out_dir / "checkpoints") if cfg.resume else None
    if latest is not None and (latest / "config.json").exists():
        model_cfg = ModelConfig.from_hf(latest)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    pc = parallel_layout(cfg, model_cfg, world_size)

    owns_process_group = pc is not None and not dist.is_initialized()
    if owns_process_group:
        init_distributed()
    try:
        _train(cfg, pc, model_cfg, tokenizer, latest, out_dir)
    finally:
        if owns_process_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, pc: ParallelConfig | None, model_cfg: ModelConfig, tokenizer, latest, out_dir: Path):
    from seekforge.model.model import build_model
    from seekforge.parallel.mesh import build_mesh
    from seekforge.parallel.parallelize import parallelize
    from seekforge.train.trainer import Trainer, prepare_model

    is_main = pc is None or dist.get_rank() == 0
    say = print if is_main else (lambda *a, **k: None)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(model_cfg, device, torch.float32, seed=cfg.seed)  # fp32 master weights; same seed everywhere
    if pc is None:
        mesh = None
        loader, eval_batches, baseline = build_data(cfg, tokenizer)
        prepare_model(model, cfg)
    else:
        mesh = build_mesh(pc, model_cfg)
        loader, eval_batches, baseline = build_data(cfg, tokenizer, mesh["dp"].get_local_rank(), mesh["dp"].size())
        if pc.pp > 1:
            from seekforge.parallel.pp import PipelineRunner

            model = PipelineRunner(model, pc, mesh)  # cuts the stages, then parallelizes each
            for stage in model.modules:
                stage.mtp_loss_scale = cfg.mtp_loss_scale
        else:
            parallelize(model, pc, mesh)  # TP → EP → recompute → compile → FSDP
    trainer = Trainer(cfg, model, loader, eval_batches, out_dir, mesh=mesh, baseline=baseline)
    if latest is not None:
        trainer.resume(latest)
    elif is_main:  # a fresh start: an old run's curve and checkpoints in the same directory would mix in
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "train_config.yaml").write_text(yaml.safe_dump(train_config_to_dict(cfg), sort_keys=False))
    if pc is not None:
        dist.barrier()  # the fresh-start cleanup is done before any rank saves

    counts = model_cfg.num_params()
    say(f"seekforge pretrain → {out_dir}")
    say(f"model: preset {cfg.preset}, {counts['total'] / 1e6:.1f}M params ({counts['active'] / 1e6:.1f}M "
        f"activated, +{counts['mtp'] / 1e6:.1f}M MTP), vocab {model_cfg.vocab_size}, {model_cfg.num_hidden_layers} "
        f"layers, {model_cfg.n_routed_experts} experts top-{model_cfg.num_experts_per_tok}")
    if pc is not None:
        layout = {k: getattr(pc, k) for k in ("dp_replicate", "dp_shard", "tp", "ep", "pp") if getattr(pc, k) > 1}
        say(f"parallel: {dist.get_world_size()} ranks ({dist.get_backend()}), "
            f"{', '.join(f'{k}={v}' for k, v in layout.items()) or 'no split'}")
    say(f"data: {cfg.data}, {trainer.tokens_per_step:,} tokens/step × {cfg.steps} steps; "
        f"{cfg.dtype} on {device}; {trainer.flops_per_token / 1e6:.1f} MFLOP/token, "
        f"peak {trainer.peak_flops / 1e9:.0f} GFLOP/s per device ({'measured' if not cfg.peak_flops else 'given'})")
    say(f"unigram-entropy baseline: {baseline:.3f} nats/token (the best loss without context)")
    if latest is not None:
        say(f"resumed from {latest} at step {trainer.step}")

    start = time.perf_counter()
    history = trainer.fit()
    elapsed = time.perf_counter() - start
    if history:
        last = history[-1]
        final = f"lm loss {last['lm_loss']:.3f}" if "lm_loss" in last else f"loss {last['loss']:.3f}"
        say(f"done: {len(history)} steps in {elapsed:.0f}s; final {final}, "
            f"eval loss {last.get('eval_loss', float('nan')):.3f} vs unigram entropy {baseline:.3f} nats/token")
    else:
        say(f"nothing to train: {out_dir} already holds step {trainer.step}/{cfg.steps} (--no-resume restarts)")
    say(f"metrics: {out_dir / 'metrics.jsonl'}, tensorboard: {out_dir / 'tensorboard'}, plot: {out_dir / 'loss.png'}")

    if not (cfg.export_hf or cfg.sample_prompt):
        return
    plain = plain_copy(model, model_cfg, mesh)  # every rank takes part in the gather; rank 0 gets the weights
    if not is_main:
        return
    sample_model = plain
    if cfg.export_hf:
        from seekforge.generate import load_model

        hf_dir = export_hf(plain, tokenizer, cfg, out_dir / "hf")
        sample_model, _ = load_model(str(hf_dir))  # sampling from the export also proves it loads
    if cfg.sample_prompt:
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


def plain_copy(model, model_cfg: ModelConfig, mesh=None):
    """The trained weights in an unwrapped, uncompiled, unsharded CPU Transformer (generation uses
    KV caches; save_hf writes plain tensors). A collective under torch.distributed: every rank must
    call it; rank 0 gets the model, the others None. model: a Transformer or a PipelineRunner."""
    from seekforge.model.model import Transformer

    if isinstance(model, torch.nn.Module):
        # Full (unsharded) tensors gathered onto rank 0's CPU, under the plain parameter names.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        # Pipeline stages live on other ranks than 0: every rank gathers its stages' full tensors
        # over dp/tp, and one rank per stage sends them to rank 0.
        state = {}
        for stage in model.modules:
            state.update(get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True)))
        sender = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
        state = {k: v.cpu() for k, v in state.items()} if sender else {}
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state, parts, dst=0)
        state = {k: v for part in parts or [] for k, v in part.items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    plain = Transformer(model_cfg)
    plain.load_state_dict(state)
    return plain.eval()


def print_sample(model, tokenizer, prompt: str) -> None:
    from seekforge.generate import generate

    ids = tokenizer.encode(prompt)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    # Greedy decoding of a minutes-old model loops on its most frequent words; a seeded,
    # temperature-0.8 top-40 sample shows better what it learned, and is reproducible.
    new = generate(model, ids, max_new_tokens=160, temperature=0.8, top_k=40, seed=0, stop_token_ids=stop)
    print(f"sample (temperature 0.8, top-k 40): {prompt!r} → {tokenizer.decode(new)!r}")
