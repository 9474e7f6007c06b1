"""A pretraining run from a TrainConfig: tokenizer, data, model, layout, the Trainer, the HF export
and a sample — what `seekforge pretrain` (train/cli.py) runs, callable from Python:

    from seekforge.config import TrainConfig
    from seekforge.train.pretrain import pretrain
    pretrain(TrainConfig(preset="tiny", steps=50, data="builtin:arithmetic"))

Under torchrun the same call trains one model over all ranks: every rank builds the model from the
same seed, `parallel/parallelize` lays it out (or parallel/pp.py cuts it into pipeline stages), and
each data-parallel rank trains on its slice of the same global batch (micro_batch_size is global), so
the losses are the single-device run's. Rank 0 alone prints, logs and exports.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from seekforge.config import ModelConfig, ParallelConfig, TrainConfig
from seekforge.data.corpora import unigram_entropy
from seekforge.data.dataset import BatchLoader, build_datasets
from seekforge.errors import UserError
from seekforge.model.generate import generate
from seekforge.model.hf import save_hf
from seekforge.model.load import check_tokenizer_fits, load_model
from seekforge.model.model import Transformer, build_model
from seekforge.model.precision import resolve_dtype
from seekforge.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from seekforge.parallel.mesh import build_mesh, init_distributed
from seekforge.parallel.parallelize import parallelize
from seekforge.train.checkpoint import check_resumed_model, latest_checkpoint, step_dirs
from seekforge.train.config_file import config_to_dict
from seekforge.train.metrics import start_over
from seekforge.train.optim import lr_at
from seekforge.train.trainer import Trainer, prepare_model


def run_model(cfg: TrainConfig) -> tuple[ModelConfig, ByteTokenizer | HFTokenizer, Path | None]:
    """The model a run trains, its tokenizer, and the checkpoint it resumes from (None: a new run): the one place
    pretrain's ModelConfig is assembled (`pretrain` and its --dry-run both call it).

    A resumed run keeps its own model, the checkpoint's config.json; the tokenizer must fit it, and every model key
    this config sets must agree with it. A new run: the preset with the `model` overrides (TrainConfig.model_config),
    vocab_size the tokenizer's rounded up to a multiple of 64 (aligned matmul shapes; the extra rows are never
    targets) and the tokenizer's BOS/EOS ids (the export's config.json and generation_config.json carry them),
    each unless the `model` overrides set it."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    latest = latest_checkpoint(Path(cfg.out_dir) / "checkpoints", cfg.checkpoint_fallback) if cfg.resume else None
    if latest is not None and (latest / "config.json").exists():
        model_cfg = ModelConfig.from_hf(latest)
        check_tokenizer_fits(tokenizer, model_cfg, cfg.tokenizer, latest / "config.json")
        check_resumed_model(cfg.out_dir, cfg.model, "the config's model table (--set model.KEY=...)")
        return model_cfg, tokenizer, latest
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    model_cfg = cfg.model_config() if "vocab_size" in cfg.model else cfg.model_config(
        vocab_size=64 * math.ceil(tokenizer.vocab_size / 64))
    if tokenizer.vocab_size > model_cfg.vocab_size:  # only an explicit model.vocab_size can be too small
        check_tokenizer_fits(tokenizer, model_cfg, cfg.tokenizer, "model.vocab_size")
    return model_cfg.replace(**{k: v for k, v in special.items() if k not in cfg.model}), tokenizer, latest


def available_memory(device: torch.device) -> int | None:
    """Bytes free for this process's tensors: the GPU's free memory, or the host's MemAvailable
    shared by the ranks on this host; None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    return None if kib is None else kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_fits(model_cfg: ModelConfig, world_size: int, device: torch.device) -> None:
    """Fail before allocating when the weights, gradients and AdamW state alone (16 bytes per fp32
    parameter, spread over the ranks) exceed the memory free here: otherwise a model far too big
    for the machine ends in the OOM killer, with no message at all. A lower bound: activations come on top."""
    need = 16 * model_cfg.num_params()["total"] // world_size
    free = available_memory(device)
    if free is not None and need > free:
        raise UserError(f"the model ({model_cfg.num_params()['total'] / 1e9:.2f}B parameters) needs at least "
                        f"{need / 2**30:.1f} GiB per rank for fp32 weights, gradients and AdamW state, but "
                        f"{device.type} has {free / 2**30:.1f} GiB free; pick a smaller preset or model overrides, "
                        "or spread it over more ranks (torchrun + --parallel); `seekforge plan memory` estimates "
                        "a layout")


def build_data(cfg: TrainConfig, tokenizer, dp_rank: int = 0, dp_size: int = 1):
    """Training loader, fixed eval batches and the unigram-entropy baseline (nats/token); the
    loader and eval batches hold data-parallel rank `dp_rank`'s rows of each global batch."""
    samples_per_step = cfg.micro_batch_size * cfg.grad_accum
    # Held out by document (cfg.split, Megatron's --split): eval reads only the valid split's documents.
    train_set, eval_set, _ = build_datasets(cfg.data, tokenizer, cfg.seq_len, cfg.seed, (
        cfg.steps * samples_per_step, cfg.eval_batches * cfg.micro_batch_size, 0), cfg.split)
    loader = BatchLoader(train_set, cfg.micro_batch_size, cfg.seed, dp_rank, dp_size)
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
    if pc.cp > 1:
        _check_cp(cfg, pc)
    dp = pc.dp_replicate * pc.dp_shard
    if cfg.micro_batch_size % dp:
        raise ValueError(f"micro_batch_size={cfg.micro_batch_size} (the global batch) does not split over "
                         f"dp_replicate*dp_shard={dp} data-parallel ranks; make it a multiple of {dp}")
    if pc.pp > 1 and (cfg.micro_batch_size // dp) % pc.microbatches:
        raise ValueError(f"each data-parallel rank's {cfg.micro_batch_size // dp} samples do not split into "
                         f"microbatches={pc.microbatches}; make micro_batch_size a multiple of "
                         f"{dp * pc.microbatches}")
    return pc


def _check_cp(cfg: TrainConfig, pc: ParallelConfig) -> None:
    """What context parallelism needs of the run: rows that cut into 2·cp equal chunks."""
    if cfg.seq_len % (2 * pc.cp):
        raise ValueError(f"cp={pc.cp} cuts every row into {2 * pc.cp} equal chunks, but seq_len={cfg.seq_len}; "
                         f"use a seq_len divisible by {2 * pc.cp}")


def say_schedule_changes(saved_config: Path, cfg: TrainConfig, step: int, say) -> None:
    """One line when a resume changes the lr schedule from the saved run's (train_config.yaml): the new one applies
    from the step reached (Trainer.resume)."""
    if not saved_config.exists():
        return
    saved = yaml.safe_load(saved_config.read_text()) or {}
    keys = ("steps", "lr", "min_lr", "warmup", "schedule", "decay_fraction")
    changed = [f"{k} {saved[k]} → {getattr(cfg, k)}" for k in keys if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        say(f"resuming with another lr schedule ({', '.join(changed)}): this config's applies from step {step}, "
            f"lr {lr_at(step, cfg.optimizer_config()):.3g}")


def pretrain(cfg: TrainConfig) -> list[dict]:
    """Run (or resume) the pretraining run `cfg` describes. Returns the per-step metrics of this call
    (rank 0's view under torchrun)."""
    out_dir = Path(cfg.out_dir)
    torch.manual_seed(cfg.seed)
    model_cfg, tokenizer, latest = run_model(cfg)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    pc = parallel_layout(cfg, model_cfg, world_size)
    check_fits(model_cfg, world_size, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
               else torch.device("cpu"))

    owns_process_group = pc is not None and not dist.is_initialized()
    if owns_process_group:
        init_distributed(timeout_s=cfg.dist_timeout_s)
    try:
        return _train(cfg, pc, model_cfg, tokenizer, latest, out_dir)
    finally:
        if owns_process_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, pc: ParallelConfig | None, model_cfg: ModelConfig, tokenizer, latest,
           out_dir: Path) -> list[dict]:
    is_main = pc is None or dist.get_rank() == 0
    say = print if is_main else (lambda *a, **k: None)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    compute_dtype, dtype_reason = resolve_dtype(cfg.dtype, device, model_cfg.hidden_size)
    say(f"seekforge pretrain → {out_dir}")
    say(f"compute dtype: {dtype_reason}")
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

            autocast_dtype = compute_dtype if compute_dtype != torch.float32 else None
            model = PipelineRunner(model, pc, mesh, cfg.mtp_loss_scale, autocast_dtype)  # cuts, then parallelizes
        else:
            parallelize(model, pc, mesh)  # TP → EP → recompute → compile → FSDP
    trainer = Trainer(cfg, model, loader, eval_batches, out_dir, mesh=mesh, baseline=baseline)
    if latest is not None:
        trainer.resume(latest)
        if is_main:
            say_schedule_changes(out_dir / "train_config.yaml", cfg, trainer.step, say)
    elif is_main:  # a fresh start: an old run's curve and checkpoints in the same directory would mix in
        old = step_dirs(out_dir / "checkpoints") if (out_dir / "checkpoints").is_dir() else []
        if old:
            say(f"--no-resume: starting over; the earlier run's {len(old)} checkpoint(s) and metrics are removed")
        start_over(out_dir, "loss.png")
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "train_config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    if pc is not None:
        dist.barrier()  # the fresh-start cleanup is done before any rank saves

    _describe(cfg, pc, model_cfg, trainer, compute_dtype, device, baseline, latest, say)
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

    if cfg.export_hf or cfg.sample_prompt:
        _export_and_sample(cfg, model, model_cfg, mesh, tokenizer, out_dir / "hf", is_main)
    return history


def _describe(cfg: TrainConfig, pc: ParallelConfig | None, model_cfg: ModelConfig, trainer: Trainer, compute_dtype,
              device, baseline: float, latest, say) -> None:
    """The run's opening lines: model, layout, data and throughput basis, baseline, warnings."""
    counts = model_cfg.num_params()
    say(f"model: preset {cfg.preset}, {counts['total'] / 1e6:.1f}M params ({counts['active'] / 1e6:.1f}M "
        f"activated, +{counts['mtp'] / 1e6:.1f}M MTP), vocab {model_cfg.vocab_size}, {model_cfg.num_hidden_layers} "
        f"layers, {model_cfg.n_routed_experts} experts top-{model_cfg.num_experts_per_tok}")
    if pc is not None:
        layout = {k: getattr(pc, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp") if getattr(pc, k) > 1}
        say(f"parallel: {dist.get_world_size()} ranks ({dist.get_backend()}), "
            f"{', '.join(f'{k}={v}' for k, v in layout.items()) or 'no split'}")
    say(f"data: {cfg.data}, {trainer.tokens_per_step:,} tokens/step × {cfg.steps} steps; "
        f"{str(compute_dtype).removeprefix('torch.')} on {device}; {trainer.flops_per_token / 1e6:.1f} MFLOP/token, "
        f"peak {trainer.peak_flops / 1e9:.0f} GFLOP/s per device ({'measured' if not cfg.peak_flops else 'given'})")
    say(f"unigram-entropy baseline: {baseline:.3f} nats/token (the best loss without context)")
    if cfg.warmup >= cfg.steps:
        say(f"warning: warmup={cfg.warmup} >= steps={cfg.steps}: the learning rate never reaches lr={cfg.lr:g} nor "
            f"decays; --set warmup=N with N < {cfg.steps}")
    if latest is not None:
        say(f"resumed from {latest} at step {trainer.step}")


def _export_and_sample(cfg: TrainConfig, model, model_cfg: ModelConfig, mesh, tokenizer, hf_dir: Path,
                       is_main: bool) -> None:
    """The HF export and the sample at the end of a run; a collective (every rank takes part in the gather)."""
    plain = plain_copy(model, model_cfg, mesh)  # rank 0 gets the weights
    if not is_main:
        return
    sample_model = plain
    if cfg.export_hf:
        export_hf(plain, tokenizer, hf_dir)
        sample_model, _ = load_model(str(hf_dir))  # sampling from the export also proves it loads
    if cfg.sample_prompt:
        print_sample(sample_model, tokenizer, cfg.sample_prompt)


def export_hf(model, tokenizer, hf_dir: Path) -> Path:
    save_hf(model, hf_dir)
    tokenizer.save(hf_dir)  # a tokenizer.json that transformers.AutoTokenizer loads, the byte tokenizer too
    print(f"HF checkpoint: {hf_dir} (load with transformers or `seekforge generate --model {hf_dir}`)")
    return hf_dir


def plain_copy(model, model_cfg: ModelConfig, mesh=None):
    """The trained weights in an unwrapped, uncompiled, unsharded CPU Transformer (generation uses
    KV caches; save_hf writes plain tensors). A collective under torch.distributed: every rank must
    call it; rank 0 gets the model, the others None. model: a Transformer or a PipelineRunner."""
    if isinstance(model, torch.nn.Module):
        # Full (unsharded) tensors gathered onto rank 0's CPU, under the plain parameter names.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        # Pipeline stages live on other ranks than 0: every rank gathers its stages' full tensors
        # over dp/tp, and one rank per stage sends them to rank 0.
        state = {}
        for stage in model.modules:
            state.update(get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True)))
        sender = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0 and (
            "cp" not in mesh.batch.mesh_dim_names or mesh["cp"].get_local_rank() == 0)  # cp ranks hold copies
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
    ids = tokenizer.encode(prompt)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    # Greedy decoding of a minutes-old model loops on its most frequent words; a seeded,
    # temperature-0.8 top-40 sample shows better what it learned, and is reproducible.
    new = generate(model, ids, max_new_tokens=160, temperature=0.8, top_k=40, seed=0, stop_token_ids=stop)
    print(f"sample (temperature 0.8, top-k 40): {prompt!r} → {tokenizer.decode(new)!r}")
