"""The built-in starting checkpoint: a short pretrain on the arithmetic task's documents, so that
`seekforge grpo` with no arguments has a policy that answers the task's questions right only
sometimes — the regime where GRPO has something to reinforce.

Its corpus imitates one with mistakes (GRPOConfig.base_slip_share: two thirds of the answers that need a
carry drop it), so a base that has learned the task knows both the right way and the slip and greedily
answers most carried questions with the slip: the capability is in the base, its preference is wrong,
and the reward has something quick to move. With a clean corpus (share 0) the base is still learning the
units digit when it stops, which a few hundred GRPO steps barely move.

It runs train/'s Trainer unchanged on a stream of the task's documents (each followed by the
end-of-document token, as data/dataset builds the built-in corpora) and exports the weights as an HF
checkpoint that the GRPO run (and a resumed one, for its reference model) loads.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np

from seekforge.config import TrainConfig
from seekforge.data.corpora import ArithmeticTask
from seekforge.data.dataset import BatchLoader
from seekforge.rl.config import DEFAULT_BASE_MODEL, GRPOConfig

# A plateau only counts once the base answers this share of held-out questions: before its accuracy jumps
# it creeps up from ~1% with long flat stretches that are not the end of its learning.
PLATEAU_FLOOR = 0.3


class StopRule:
    """When the base's pretraining ends, from its held-out accuracy at each check: at the target, or on a
    plateau — `patience` checks in a row without a better accuracy, once the best reached PLATEAU_FLOOR
    (patience 0: never on a plateau)."""

    def __init__(self, target: float, patience: int):
        self.target, self.patience = target, patience
        self.best, self.since_best = 0.0, 0

    def check(self, accuracy: float) -> str | None:
        """→ "target", "plateau", or None to keep training."""
        if accuracy > self.best:
            self.best, self.since_best = accuracy, 0
        else:
            self.since_best += 1
        if accuracy >= self.target:
            return "target"
        if self.patience and self.best >= PLATEAU_FLOOR and self.since_best >= self.patience:
            return "plateau"
        return None


class TaskWindows:
    """num_windows windows of seq_len + 1 tokens cut from a stream of the task's documents, leaving out
    the documents of `held_out` questions (prompts as ArithmeticTask.sample writes them): the GRPO run's
    held-out accuracy must measure questions no phase trained on (level 2 has only ~950 distinct ones)."""

    def __init__(self, tokenizer, levels: list[int], seq_len: int, num_windows: int, seed: int,
                 held_out: frozenset[str] = frozenset(), slip_share: float = 0.0):
        task, rng = ArithmeticTask(seed, tuple(levels), slip_share), random.Random(f"base-{seed}")
        stream: list[int] = []
        while len(stream) < num_windows * seq_len + 1:
            document = task.document(rng)
            if document[:document.index(" A:") + len(" A:")] in held_out:
                continue
            stream += tokenizer.encode(document) + [tokenizer.eos_token_id]
        tokens = np.asarray(stream[:num_windows * seq_len + 1], dtype=np.int64)
        self.windows = [tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(num_windows)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.windows[i][:-1], "labels": self.windows[i][1:]}


def base_train_config(cfg: GRPOConfig, tokenizer, out_dir: Path) -> TrainConfig:
    model = {**DEFAULT_BASE_MODEL, "vocab_size": 64 * math.ceil(tokenizer.vocab_size / 64), **cfg.model}
    return TrainConfig(preset="tiny", model=model, seq_len=128, micro_batch_size=16, steps=cfg.base_steps,
                       lr=cfg.base_lr, min_lr=cfg.base_lr / 10, warmup=min(20, cfg.base_steps // 10), dtype="fp32",
                       mtp_loss_scale=0.0, seed=cfg.seed, out_dir=str(out_dir), log_interval=0, eval_interval=0,
                       save_interval=0, peak_flops=1e11, export_hf=False, sample_prompt="")


def prepare_base(cfg: GRPOConfig, tokenizer, out_dir: Path, progress: bool = True) -> Path:
    """Pretrain the built-in base into out_dir (once: an existing export is reused) → its HF directory.

    Pretraining checks the held-out greedy accuracy every `base_check_interval` steps and stops at the
    first check that reaches `base_target_accuracy`, or once the accuracy has plateaued — no better check
    in `base_patience` checks, after it first reached PLATEAU_FLOOR — or after base_steps. GRPO should
    start from a model that is right sometimes and has learned what its corpus teaches: the slip base's
    accuracy rises in a sudden jump (between ~1,200 and ~3,600 steps in the runs measured: the data order
    and even the thread count move it) and then levels off near 50%, right on the carry-free questions and
    slipping on the others."""
    from seekforge.model.hf import save_hf
    from seekforge.model.model import build_model
    from seekforge.rl.data import ArithmeticPrompts
    from seekforge.rl.evaluate import held_out_accuracy
    from seekforge.train.trainer import Trainer

    hf_dir = out_dir / "hf"
    if (hf_dir / "config.json").exists():
        return hf_dir
    train_cfg = base_train_config(cfg, tokenizer, out_dir)
    model = build_model(train_cfg.model_config(), seed=cfg.seed)
    held_out = frozenset(s.prompt for s in ArithmeticPrompts(cfg.task_levels, cfg.seed, cfg.eval_prompts).eval_set)
    windows = TaskWindows(tokenizer, cfg.task_levels, train_cfg.seq_len,
                          train_cfg.steps * train_cfg.micro_batch_size, cfg.seed, held_out, cfg.base_slip_share)
    trainer = Trainer(train_cfg, model, BatchLoader(windows, train_cfg.micro_batch_size, cfg.seed), out_dir=out_dir)
    stop = StopRule(cfg.base_target_accuracy, cfg.base_patience)
    while trainer.step < train_cfg.steps:
        trainer.fit(stop_at=trainer.step + cfg.base_check_interval)
        accuracy = held_out_accuracy(model, tokenizer, cfg)
        reason = stop.check(accuracy)
        if progress:
            print(f"base model: step {trainer.step}, held-out accuracy {accuracy:.3f}"
                  f"{f' ({reason}: stopping)' if reason else ''}", flush=True)
        if reason:
            break
    save_hf(model, hf_dir)
    return hf_dir
