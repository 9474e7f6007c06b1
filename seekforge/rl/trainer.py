"""The GRPO loop: rollout → score → update, then the engine serves the new weights.

One iteration (`step`):
  1. rollout (rl/rollout.py): the step's prompts (a pure function of seed and step, so resume needs no
     data cursor beyond the step, rl/data.py) × G seeded completions through the co-located engine;
     the engine then sleeps (KV pool freed) for the training phase;
  2. score (rl/score.py): rewards, then advantages over each prompt's group;
  3. update (rl/update.py): this rank's sequences packed into rows; old log-probs (when μ > 1) and
     reference log-probs (when β > 0) on those rows, all at the sampling temperature; μ optimizer steps
     over the whole batch, each the sum of the rows' gradients;
  4. the engine's weights take the update (rl/replica.py) and its prefix cache is dropped.
Under torchrun each rank runs this with its own engine; the policy is FSDP-sharded over the ranks
(`fsdp`, the default) or replicated (rl/collectives.py). Training state lives in train/'s checkpoint
format (DCP: policy, optimizer, scheduler, the prompt position, RNG); the reference model is the base
checkpoint, rebuilt from it on resume. Held-out accuracy: rl/evaluate.py.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from seekforge.model.precision import resolve_dtype
from seekforge.parallel.recompute import apply_recompute
from seekforge.probe.training import TrainingProbe
from seekforge.rl.algorithm import LossSettings, sequence_weights, token_share
from seekforge.rl.collectives import distributed, is_main, shard_policy, sum_gradients_over_ranks, sum_over_ranks
from seekforge.rl.config import GRPOConfig
from seekforge.rl.data import prompt_dataset
from seekforge.rl.evaluate import evaluate
from seekforge.rl.replica import EngineWeights
from seekforge.rl.report import append_samples
from seekforge.rl.rewards import RewardError, RewardSet
from seekforge.rl.rollout import Rollout, encode_prompt, engine_config, offload, rollout_seeds, sample_groups
from seekforge.rl.score import ScoredBatch, score_groups
from seekforge.rl.update import (
    TrainingBatch,
    accumulate_gradients,
    entropy_masks,
    in_loss,
    pack_my_sequences,
    sequence_log_probs,
)
from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from seekforge.train.master import MasterWeights, can_use_master_weights
from seekforge.train.metrics import MetricsLogger
from seekforge.train.optim import build_optimizer, clip_grad_norm, follow_schedule


class GRPOTrainer:
    def __init__(self, cfg: GRPOConfig, policy, tokenizer, reference=None, out_dir: str | Path | None = None):
        """policy: the Transformer to train (the engine runs on this very module where it can); reference:
        a frozen copy of the starting policy, needed when cfg.beta > 0."""
        if cfg.beta > 0 and reference is None:
            raise ValueError(f"beta={cfg.beta} needs a reference model; pass one or set beta=0")
        self.cfg, self.policy, self.tokenizer, self.reference = cfg, policy, tokenizer, reference
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.device = policy.embed_tokens.weight.device
        # GRPO trains the next-token head only: MTP modules get no gradient, so they are not trained
        # (and the optimizer keeps no state for them, which a checkpoint's optimizer state must match).
        policy.mtp.requires_grad_(False)
        # One dtype for both phases, what `auto` picks for batched work (model/precision.py): training
        # computes in it (bf16: bf16 copies of the fp32 master weights, below) and the engine generates in it.
        self.compute_dtype, self.dtype_reason = resolve_dtype(cfg.dtype, self.device, policy.cfg.hidden_size)
        self.sharded = distributed() and cfg.fsdp
        if cfg.recompute != "none":  # before the engine's replica is copied: its parameter names stay the policy's
            apply_recompute(policy, cfg.recompute)
        self.engine_weights = EngineWeights(policy, self.compute_dtype, self.sharded)
        self.engine_model = self.engine_weights.model
        if self.sharded:
            shard_policy(policy)
        # bf16 training on one process: bf16 matmul weights over the fp32 masters, as in pretraining
        # (train/master.py), not autocast's cast of every weight and of every row's weight gradients. The
        # engine's replica holds exactly those bf16 weights: it is their storage.
        self.master_weights = None
        if self.compute_dtype == torch.bfloat16 and not self.sharded and can_use_master_weights(policy):
            self.master_weights = MasterWeights(policy, copies=self.engine_model)
        self.optimizer, self.scheduler = build_optimizer(policy, cfg.optimizer_config())
        self.rewards = RewardSet(list(cfg.rewards), list(cfg.reward_weights), cfg.reward_errors, cfg.max_new_tokens)
        # the prompts (rl/data.py): the built-in task or the user's data
        self.prompt_stream = prompt_dataset(cfg.data, cfg.seed, cfg.eval_prompts, cfg.task_levels, cfg.eval_data,
                                            tokenizer)
        self.loss_settings = LossSettings(cfg.loss_type, cfg.clip_low, cfg.clip_high, cfg.beta, cfg.temperature,
                                          cfg.use_bias_correction_kl, cfg.importance_sampling_level, cfg.delta,
                                          cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        self.rollout = Rollout(self.engine_model, tokenizer, engine_config(cfg))
        self.moe_layers = policy.moe_layers()
        self.step_count = 0
        self.saved_step = None
        # Phase timings (Prometheus), on-demand traces, and from cfg.probe the monitor and dumps, as in
        # pretraining; phases here: rollout, rewards, backward, optimizer.
        self.probe = TrainingProbe.open(cfg.probe, [policy], [self.optimizer], self.out_dir)
        if reference is not None:
            reference.requires_grad_(False).eval()
            self._park(reference)

    # ------------------------------------------------------------------ state
    def save(self) -> Path:
        self.saved_step = self.step_count
        return save_checkpoint(self.out_dir / "checkpoints", self.step_count, self.policy, self.optimizer,
                               self.scheduler, self.prompt_stream, keep=self.cfg.keep_checkpoints)

    def _saving_on_reward_error(self, call, logger, bar=None, metrics: dict | None = None):
        """call() → its result. A failed reward (reward_errors="raise") stops the run: the step's `metrics` are
        logged, and the run's state at its last completed step is saved (none before the first), so that the
        fixed reward resumes the run."""
        try:
            return call()
        except RewardError as e:
            if metrics is not None:  # the held-out grading failed after the step
                logger.log(self.step_count, metrics)
            for record in (logger, bar):
                if record is not None:
                    record.close()
            if self.step_count and self.saved_step != self.step_count:
                self.save()
            where = (f"the run's state at step {self.step_count} is saved in {self.out_dir / 'checkpoints'}; fix "
                     "the reward and rerun the same command to resume" if self.step_count else
                     "no step had completed (nothing saved)")
            raise RewardError(e.reward, f"{e}; {where}") from e

    def resume(self, path: str | Path | None = None) -> bool:
        path = path or latest_checkpoint(self.out_dir / "checkpoints", self.cfg.checkpoint_fallback)
        if path is None:
            return False
        self.step_count = load_checkpoint(path, self.policy, self.optimizer, self.scheduler, self.prompt_stream)
        self.saved_step = self.step_count
        follow_schedule(self.optimizer, self.scheduler, self.cfg.lr)
        self._weights_updated()
        return True

    def _weights_updated(self) -> None:
        """The engine serves the policy's current weights: a replica takes them, and the prefix cache goes."""
        self.engine_weights.refresh()
        self.rollout.weights_updated()

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _compute_weights(self, refresh: bool):
        """The bf16 matmul weights for one row's forward + backward (train/master.py), where used."""
        return self.master_weights.compute(refresh) if self.master_weights is not None else contextlib.nullcontext()

    def _park(self, module_or_optimizer) -> None:
        """Off the compute device while idle (on CPU there is nowhere else to go)."""
        if self.cfg.swap and self.device.type != "cpu":
            offload(module_or_optimizer, "cpu")

    def _unpark(self, module_or_optimizer) -> None:
        if self.cfg.swap and self.device.type != "cpu":
            offload(module_or_optimizer, self.device)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> dict:
        cfg, step = self.cfg, self.step_count
        samples = self.prompt_stream.prompts(step, cfg.prompts_per_step)
        prompt_ids = [encode_prompt(self.tokenizer, sample.prompt) for sample in samples]
        self.probe.begin_step(step + 1, record=False)  # the dump and monitor watch training, not rollouts
        start = time.perf_counter()
        mine, local = sample_groups(self.rollout, prompt_ids, rollout_seeds(cfg.seed, step, len(samples),
                                                                            cfg.group_size), cfg)
        rollout_time = time.perf_counter() - start
        if cfg.swap:
            self.rollout.sleep()
        self.probe.mark("rollout")
        self.probe.start_recording(step + 1)

        start = time.perf_counter()
        scored = score_groups(self.rewards, self.tokenizer, samples, mine, local, cfg.group_size, cfg.scale_rewards)
        if cfg.sample_interval and (step + 1) % cfg.sample_interval == 0 and is_main():
            append_samples(self.out_dir / "samples.jsonl", step + 1, samples, scored, self.tokenizer,
                           self.rewards.names)
        seqs, rows = pack_my_sequences(prompt_ids, scored.completions, cfg.group_size, cfg.max_pack_tokens,
                                       cfg.max_pack_count, self.compute_dtype, self.device, self.sharded)
        scored_mask = in_loss(scored.completions, self.stop_ids, cfg.mask_truncated_completions)
        batch = self._training_batch(scored, scored_mask, seqs, rows)
        lengths = [len(c) for c in scored.completions]
        self.probe.mark("rewards")  # rewards, advantages, packing, old and reference log-probs
        sums, grad_norm = self._update(rows, batch, seqs, scored_mask)
        self._weights_updated()
        train_time = time.perf_counter() - start
        self.step_count += 1
        self.prompt_stream.position = self.step_count

        sums = sum_over_ranks(sums)
        num_tokens = sum(len(prompt_ids[i // cfg.group_size]) + n for i, n in enumerate(lengths))
        metrics = scored.metrics
        metrics.update(
            loss=sums["loss"], clip_fraction=sums["clipped"], entropy=sums["entropy"], grad_norm=grad_norm.item(),
            response_length=sum(lengths) / len(lengths), lr=self.scheduler.get_last_lr()[0],
            rollout_tokens_per_s=sum(lengths) / rollout_time, train_tokens_per_s=num_tokens * cfg.mu / train_time,
            rollout_time_s=rollout_time, train_time_s=train_time, packed_rows=len(rows))
        if cfg.beta > 0:
            metrics["kl"] = sums["kl"]
        self.probe.end_step(self.step_count, metrics)
        return metrics

    @property
    def stop_ids(self) -> set[int]:
        """The tokens a finished completion ends on (mask_truncated_completions: the others were cut)."""
        ends = (self.tokenizer.eos_token_id, getattr(self.tokenizer, "pad_token_id", None))
        return {t for t in ends if t is not None}

    def _training_batch(self, scored: ScoredBatch, scored_mask: torch.Tensor, seqs: list[int], rows) -> TrainingBatch:
        """This rank's sequences with their advantages and loss weights (from the whole batch), and their
        log-probs under the policy before the update (μ > 1: the ratio's denominator) and under the
        reference (β > 0), at the sampling temperature."""
        cfg = self.cfg
        lengths = torch.tensor([len(c) for c in scored.completions])
        weights = sequence_weights(cfg.loss_type, lengths, cfg.max_new_tokens, scored_mask, cfg.micro_batch_size)
        with self._autocast():
            old = sequence_log_probs(self.policy, rows, len(seqs), cfg.temperature)[0] if cfg.mu > 1 else None
        ref = None
        if cfg.beta > 0:
            self._unpark(self.reference)
            with self._autocast():
                ref = sequence_log_probs(self.reference, rows, len(seqs), cfg.temperature)[0]
            self._park(self.reference)
        return TrainingBatch(lengths[seqs].tolist(), scored.advantages[seqs], old, ref, weights[seqs],
                             token_share(lengths, scored_mask)[seqs])

    def _update(self, rows, batch: TrainingBatch, seqs: list[int], scored_mask: torch.Tensor,
                ) -> tuple[dict[str, float], torch.Tensor]:
        """μ optimizer steps on the batch → (the last pass's weighted sums on this rank, its gradient norm).
        top_entropy_quantile < 1 costs a forward without a graph per optimizer step (update.entropy_masks)."""
        cfg = self.cfg
        self._unpark(self.optimizer)
        self.policy.train()
        for update in range(cfg.mu):
            with self._autocast():
                masks = None
                if cfg.top_entropy_quantile < 1:
                    masks = entropy_masks(self.policy, rows, seqs, scored_mask, cfg.micro_batch_size,
                                          cfg.top_entropy_quantile, cfg.temperature)
                sums = accumulate_gradients(self.policy, rows, batch, self.loss_settings, self._compute_weights, masks)
            if not self.sharded:  # under FSDP the reduce-scatter already summed them
                sum_gradients_over_ranks(self.policy)
            grad_norm = clip_grad_norm(list(self.policy.parameters()), cfg.clip_grad or math.inf)
            self.probe.mark("backward")
            if update == cfg.mu - 1:  # the monitor records the iteration's last optimizer step
                self.probe.before_optimizer(self.step_count + 1, grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.probe.mark("optimizer")
        for moe in self.moe_layers:  # the routing bias stays as pretrained; the counts are not used
            moe.tokens_per_expert.zero_()
        self._park(self.optimizer)
        return sums, grad_norm

    def evaluate(self) -> dict[str, float]:
        """Held-out scores on the training engine (rl/evaluate.py): eval_accuracy, eval_pass@k."""
        scores = evaluate(self.rollout, self.tokenizer, self.prompt_stream, self.cfg)
        if self.cfg.swap:
            self.rollout.sleep()
        return scores

    # ------------------------------------------------------------------ the loop
    def fit(self, stop_at: int | None = None, progress: bool = True) -> list[dict]:
        """Iterate until cfg.steps (or `stop_at`). Held-out accuracy at the start, every eval_interval
        steps and at the end. Returns this call's per-step metrics (also in metrics.jsonl)."""
        cfg = self.cfg
        end = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
        logger = MetricsLogger(self.out_dir, enabled=is_main())
        progress = progress and is_main()
        if self.step_count == 0 and cfg.eval_prompts:
            logger.log(0, self._saving_on_reward_error(self.evaluate, logger))
        history = []
        bar = tqdm(total=cfg.steps, initial=self.step_count, unit="step", dynamic_ncols=True, disable=not progress)
        while self.step_count < end:
            metrics = self._saving_on_reward_error(self.step, logger, bar)
            last = self.step_count == cfg.steps
            if cfg.eval_prompts and (last or (cfg.eval_interval and self.step_count % cfg.eval_interval == 0)):
                metrics.update(self._saving_on_reward_error(self.evaluate, logger, bar, metrics))
            history.append(metrics)
            logger.log(self.step_count, metrics)
            bar.update(1)
            postfix = {"reward": f"{metrics['reward_mean']:.2f}", "len": f"{metrics['response_length']:.1f}"}
            if "eval_accuracy" in metrics:
                postfix["acc"] = f"{metrics['eval_accuracy']:.2f}"
            bar.set_postfix(postfix, refresh=False)
            if "eval_accuracy" in metrics and progress:
                bar.write(log_line(self.step_count, cfg.steps, metrics))
            if cfg.save_interval and self.step_count % cfg.save_interval == 0 and self.step_count < end:
                self.save()
        bar.close()
        if history:
            self.save()
        logger.close()
        self.probe.close(self.step_count)
        return history


def log_line(step: int, steps: int, m: dict) -> str:
    parts = [f"step {step:>4}/{steps}", f"reward {m['reward_mean']:.3f}±{m['reward_std']:.3f}",
             f"held-out acc {m['eval_accuracy']:.3f}", f"zero-std groups {m['zero_std_groups']:.2f}",
             f"clip {m['clip_fraction']:.3f}", f"entropy {m['entropy']:.3f}", f"len {m['response_length']:.1f}",
             f"rollout {m['rollout_tokens_per_s']:,.0f} tok/s", f"train {m['train_tokens_per_s']:,.0f} tok/s"]
    if "kl" in m:
        parts.insert(4, f"kl {m['kl']:.4f}")
    return " | ".join(parts)
