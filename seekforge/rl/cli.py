"""`seekforge grpo`: GRPO post-training with co-located rollouts on seekforge's own engine.

With no arguments it runs the built-in default: it pretrains its own small base model on the
arithmetic task (a few minutes; reused when already there), then improves it with GRPO on the
task's exact-answer reward, writing runs/grpo/{metrics.jsonl, tensorboard/, reward.png,
checkpoints/, base/, samples.jsonl}. An existing run in --out-dir resumes from its latest checkpoint. `--base DIR
--data prompts.jsonl --reward mymodule:my_reward` trains another model on your own prompts and reward
(rl/data.py, rl/rewards.py).

Under torchrun (`torchrun --nproc-per-node 2 -m seekforge.cli grpo ...`) the policy and its optimizer
state are FSDP-sharded over the ranks (`--set fsdp=false`: full replicas); every rank has its own
engine, rolls out its balanced share of the prompts and trains its share of the sequences; gradients
are summed over ranks, so the run equals the one-process run.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import yaml

from seekforge.rl.algorithm import LOSS_TYPES
from seekforge.rl.config import GRPOConfig
from seekforge.rl.data import BUILTIN
from seekforge.train.config_file import command_line, config_to_dict, interrupt_hint_of, load_config

_FLAGS = [
    ("--base", "base", str, "HF checkpoint directory of the starting policy ('' = built-in base)"),
    ("--data", "data", str, "prompts: builtin:arithmetic | FILE.jsonl | FILE.parquet | DIR[:SPLIT] (datasets."
                            "save_to_disk) | hf:NAME[:CONFIG]:SPLIT; rows with a `prompt` column (text, or chat "
                            "messages rendered by the tokenizer's chat template), every other column passed to the "
                            "rewards as keywords (seekforge/rl/data.py; needs --base)"),
    ("--eval-data", "eval_data", str, "held-out prompts of their own, in any --data form ('': eval_prompts of "
                                      "--data's rows, never trained on)"),
    ("--eval-k", "eval_k", int, "pass@k at each evaluation: k completions per held-out prompt at the rollout "
                                "temperature (0: greedy accuracy only)"),
    ("--reward-errors", "reward_errors", str, "a reward that raises or returns the wrong number of values: raise "
                                              "(stop; the run's state is saved, a rerun resumes) | zero (those "
                                              "samples score 0, counted)"),
    ("--steps", "steps", int, "GRPO iterations (rollout + update)"),
    ("--prompts-per-step", "prompts_per_step", int, "prompts per rollout batch"),
    ("--group-size", "group_size", int, "completions per prompt (G)"),
    ("--max-new-tokens", "max_new_tokens", int, "completion length limit"),
    ("--loss-type", "loss_type", str, f"{' | '.join(LOSS_TYPES)} (TRL's; the other loss options, e.g. "
                                      "--set scale_rewards=batch, in seekforge/rl/config.py)"),
    ("--lr", "lr", float, "learning rate"),
    ("--beta", "beta", float, "KL-to-reference coefficient (0: no reference model)"),
    ("--seed", "seed", int, "prompts, sampling and the built-in base"),
    ("--dtype", "dtype", str, "compute dtype of training and rollouts: auto (as pretrain's auto) | bf16 | fp32 "
                              "(master weights stay fp32)"),
    ("--out-dir", "out_dir", str, "run directory"),
]
_DEFAULTS = GRPOConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "GRPO post-training. Settings: GRPOConfig defaults, then --config (YAML/TOML of GRPOConfig "
        "fields), then the flags, then --set key=value (last wins). Without --base it first pretrains "
        "its own base model on the built-in arithmetic task.")
    p.add_argument("--config", default=argparse.SUPPRESS, help="YAML or TOML file of GRPOConfig fields")
    for flag, field, kind, text in _FLAGS:
        p.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS,
                       help=f"{text} (default: {getattr(_DEFAULTS, field)!r})")
    p.add_argument("--reward", dest="rewards", action="append", default=argparse.SUPPRESS, metavar="NAME[=WEIGHT]",
                   help="reward: arithmetic | format | boxed | length | module:function | path/to/file.py:function, "
                        "a function (prompt, completion, **columns) -> float, or TRL's batched (prompts, completions, "
                        "**columns) -> list[float], either may be async (seekforge/rl/rewards.py); repeat to combine, "
                        "=WEIGHT weighs it (default 1; or --set reward_weights=[...]); default: arithmetic")
    p.add_argument("--no-resume", dest="resume", action="store_false", default=argparse.SUPPRESS,
                   help="start fresh even if OUT_DIR holds checkpoints")
    p.add_argument("--no-checkpoint-fallback", dest="checkpoint_fallback", action="store_false",
                   default=argparse.SUPPRESS, help="a damaged latest checkpoint is an error, not a fallback to "
                                                   "the newest intact older one")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any GRPOConfig field, e.g. --set mu=2 --set clip_high=0.28 (seekforge/rl/config.py)")


def config_from_args(args) -> GRPOConfig:
    path, updates, overrides = command_line(args, [f[1] for f in _FLAGS] + ["rewards", "resume", "checkpoint_fallback"])
    if "rewards" in updates:  # --reward a=0.5 --reward b: weights 0.5 and 1
        specs, weights = zip(*map(split_weight, updates["rewards"]), strict=True)
        updates["rewards"] = list(specs)
        if "reward_weights" not in overrides:
            updates["reward_weights"] = [1.0 if w is None else w for w in weights]
        elif any(w is not None for w in weights):
            raise ValueError("give the rewards' weights one way: --reward NAME=WEIGHT or --set reward_weights=[...]")
    return load_config(GRPOConfig, path, updates, overrides)


def split_weight(reward: str) -> tuple[str, float | None]:
    """--reward's NAME=WEIGHT → (NAME, WEIGHT); NAME alone → (NAME, None)."""
    name, equals, weight = reward.rpartition("=")
    if not equals:
        return reward, None
    try:
        return name, float(weight)
    except ValueError:
        raise ValueError(f"--reward {reward}: the weight after '=' must be a number, as in --reward {name}=0.5"
                         ) from None


def on_interrupt(args) -> str:
    """What Ctrl-C says (seekforge/cli.py): how to go on."""
    return interrupt_hint_of(config_from_args(args))


def run(args) -> None:
    import os

    import torch.distributed as dist

    from seekforge.parallel.mesh import init_distributed

    cfg = config_from_args(args)  # a bad config fails here, before anything is built
    if not cfg.base and cfg.data != BUILTIN:
        raise ValueError(f"data={cfg.data!r} needs --base: the built-in base model only knows the built-in arithmetic "
                         "task; give an HF checkpoint directory that can answer your prompts")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    built_in_base = Path(cfg.out_dir) / "base" / "hf"
    if world_size > 1 and not cfg.base and not (built_in_base / "config.json").exists():
        raise ValueError(f"under torchrun, give --base, or prepare the built-in base once on one process "
                         f"(`seekforge grpo --out-dir {cfg.out_dir}` writes {built_in_base})")
    owns_process_group = world_size > 1 and not dist.is_initialized()
    if owns_process_group:
        init_distributed()  # one engine per rank; the policy FSDP-sharded over them (rl/collectives.py)
    try:
        _grpo(cfg)
    finally:
        if owns_process_group:
            dist.destroy_process_group()


def _grpo(cfg: GRPOConfig) -> None:
    import torch
    import torch.distributed as dist

    from seekforge.model.load import load_model
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.rl.base import prepare_base
    from seekforge.rl.report import plot_reward_curve
    from seekforge.rl.trainer import GRPOTrainer
    from seekforge.train.checkpoint import check_resumed_model, latest_checkpoint
    from seekforge.train.metrics import read_metrics, start_over

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    say = print if is_main else (lambda *a, **k: None)
    out_dir = Path(cfg.out_dir)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    say(f"seekforge grpo → {out_dir}")
    base = cfg.base
    if not base:
        say(f"built-in base model: up to {cfg.base_steps} pretraining steps on the arithmetic task, until its held-out "
            f"accuracy reaches {cfg.base_target_accuracy:.0%} or levels off (reused if present)")
        base = str(prepare_base(cfg, load_tokenizer(cfg.tokenizer), out_dir / "base"))
        say(f"base model ready in {time.perf_counter() - start:.0f}s: {base}")
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    policy, tokenizer = load_model(base, torch.float32, device, flag="--base")
    if cfg.resume:  # a directory holding another model's run would resume that model, not this base
        check_resumed_model(out_dir, policy.cfg, f"--base {base}", new_run="--out-dir DIR")
    reference = copy.deepcopy(policy) if cfg.beta > 0 else None
    trainer = GRPOTrainer(cfg, policy, tokenizer, reference, out_dir)
    latest = latest_checkpoint(out_dir / "checkpoints", cfg.checkpoint_fallback) if cfg.resume else None
    if latest is not None:
        trainer.resume(latest)
        say(f"resumed from {latest} at step {trainer.step_count}")
    elif is_main:  # a fresh start: an old run's curve, samples and checkpoints would mix in
        start_over(out_dir, "reward.png")
        (out_dir / "samples.jsonl").unlink(missing_ok=True)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "grpo_config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    if dist.is_initialized():
        dist.barrier()  # the fresh-start cleanup is done before any rank saves
    counts = policy.cfg.num_params()
    say(f"policy: {counts['total'] / 1e6:.2f}M params from {base}; {cfg.prompts_per_step} prompts x "
        f"G={cfg.group_size} per step from {cfg.data}, {cfg.steps} steps, loss {cfg.loss_type}, beta {cfg.beta}, "
        f"mu {cfg.mu}; "
        f"rewards {dict(zip(cfg.rewards, cfg.reward_weights, strict=True))}"
        + (f"; {dist.get_world_size()} data-parallel ranks" if dist.is_initialized() else ""))
    say(f"compute dtype: {trainer.dtype_reason}")
    if trainer.step_count >= cfg.steps:
        say(f"nothing to train: {out_dir} already holds step {trainer.step_count}/{cfg.steps} (--steps N to go on, "
            "--no-resume restarts)")
    trainer.fit()
    if not is_main:
        return
    records = read_metrics(out_dir / "metrics.jsonl")
    accuracy = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    png = plot_reward_curve(out_dir / "metrics.jsonl", out_dir / "reward.png")
    if accuracy:
        (s0, a0), (s1, a1) = accuracy[0], accuracy[-1]
        say(f"held-out accuracy: {a0:.3f} at step {s0} → {a1:.3f} at step {s1} ({100 * (a1 - a0):+.1f} points)")
    say(f"done in {time.perf_counter() - start:.0f}s; metrics: {out_dir / 'metrics.jsonl'}, tensorboard: "
        f"{out_dir / 'tensorboard'}, plot: {png}")
