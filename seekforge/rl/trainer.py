"""The GRPO loop: rollout on the co-located engine → rewards → group advantages →
packed training rows → μ optimizer steps → the engine serves the new weights.

One iteration (`step`):
  1. the step's prompts (a pure function of seed and step, so resume needs no data cursor beyond
     the step) × G seeded completions through the engine (rl/rollout.py);
  2. the engine sleeps (KV pool freed) while rewards, advantages and the training phase run;
  3. old log-probs (when μ > 1) and reference log-probs (when β > 0) on the same packed rows;
  4. μ optimizer steps over the whole batch, each the sum of the rows' gradients (rl/update.py);
  5. the prefix cache is dropped: the engine's next request sees the new weights.
Under torchrun each rank runs this with its own engine; the policy is FSDP-sharded over the ranks
(`fsdp`, the default; the engine then holds a full replica that each update refreshes in memory through
the resharding planner, parallel/transfer.py) or
replicated (see the data-parallel helpers at the end). Training state lives in train/'s checkpoint
format (DCP: policy, optimizer, scheduler, the prompt position, RNG); the reference model is the base
checkpoint, rebuilt from it on resume.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from seekforge.config import EngineConfig, TrainConfig
from seekforge.data.corpora import ArithmeticTask, check_answer
from seekforge.model.dtensor import plain_tensor
from seekforge.model.precision import onednn_size, resolve_dtype, uses_onednn
from seekforge.parallel.fsdp import apply_fsdp
from seekforge.probe.training import TrainingProbe
from seekforge.rl.algorithm import BatchTotals, group_advantages
from seekforge.rl.balance import balance_groups
from seekforge.rl.config import GRPOConfig
from seekforge.rl.packing import empty_row, pack_sequences, pad_row
from seekforge.rl.rewards import RewardSet
from seekforge.rl.rollout import Rollout, offload
from seekforge.rl.update import LossSettings, TrainingBatch, accumulate_gradients, sequence_log_probs
from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from seekforge.train.master import MasterWeights, can_use_master_weights
from seekforge.train.metrics import MetricsLogger
from seekforge.train.optim import build_optimizer, clip_grad_norm, follow_schedule


class PromptStream:
    """The built-in task's prompts. Step s's prompts come from a generator seeded by (seed, s), so
    they depend only on the step; held-out prompts come from another seed and are never trained on.
    `position` (the next step) is the data position a checkpoint stores."""

    def __init__(self, levels: list[int], seed: int, num_eval: int):
        self.task, self.seed, self.position = ArithmeticTask(seed, tuple(levels)), seed, 0
        eval_rng = random.Random(f"eval-{seed}")
        self.eval_set = [self.task.sample(eval_rng) for _ in range(num_eval)]
        self._held_out = {prompt for prompt, _ in self.eval_set}

    def prompts(self, step: int, count: int) -> list[tuple[str, str]]:
        rng, out = random.Random(f"train-{self.seed}-{step}"), []
        while len(out) < count:
            prompt, answer = self.task.sample(rng)
            if prompt not in self._held_out:
                out.append((prompt, answer))
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def held_out_accuracy(model, tokenizer, cfg: GRPOConfig) -> float:
    """Greedy accuracy on the run's held-out prompts, on a throwaway engine (for the base model)."""
    rollout = Rollout(model, tokenizer, EngineConfig(kv_cache_memory=cfg.kv_cache_memory,
                                                     max_num_seqs=max(1, cfg.eval_prompts)))
    eval_set = PromptStream(cfg.task_levels, cfg.seed, cfg.eval_prompts).eval_set
    completions = rollout.generate([encode_prompt(tokenizer, p) for p, _ in eval_set], 1, cfg.max_new_tokens, 0.0)
    return sum(check_answer(tokenizer.decode(c), a) for c, (_, a) in zip(completions, eval_set, strict=True)) / \
        max(len(eval_set), 1)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Pretraining documents follow an end-of-document token (data/dataset joins documents with it),
    so a prompt starts after one, as every question the base model saw did."""
    return [tokenizer.eos_token_id, *tokenizer.encode(prompt)]


class GRPOTrainer:
    def __init__(self, cfg: GRPOConfig, policy, tokenizer, reference=None, out_dir: str | Path | None = None):
        """policy: the Transformer to train (the engine runs on this very module); reference: a frozen
        copy of the starting policy, needed when cfg.beta > 0."""
        if cfg.beta > 0 and reference is None:
            raise ValueError(f"beta={cfg.beta} needs a reference model; pass one or set beta=0")
        self.cfg, self.policy, self.tokenizer, self.reference = cfg, policy, tokenizer, reference
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.device = policy.embed_tokens.weight.device
        # GRPO trains the next-token head only: MTP modules get no gradient, so they are not trained
        # (and the optimizer keeps no state for them, which a checkpoint's optimizer state must match).
        policy.mtp.requires_grad_(False)
        # One dtype for both phases, what `auto` picks for batched work (model/precision.py): training
        # computes in it (bf16: bf16 copies of the fp32 master weights, below) and the engine generates in it. The
        # engine runs on the policy's own tensors when it can; on a replica in the compute dtype (bf16) or
        # when the policy is FSDP-sharded (under torchrun), refreshed in place from the policy after every
        # update (no file).
        self.compute_dtype, self.dtype_reason = resolve_dtype(cfg.dtype, self.device, policy.cfg.hidden_size)
        self.sharded = _distributed() and cfg.fsdp
        self._replica_plan = None  # (transfers, source dtypes) from the FSDP policy to the replica
        self.engine_model = policy
        if self.sharded or self.compute_dtype != policy.embed_tokens.weight.dtype:
            self.engine_model = copy.deepcopy(policy).requires_grad_(False).cast(self.compute_dtype)
        if self.sharded:
            shard_policy(policy)
        # bf16 training on one process: bf16 matmul weights over the fp32 masters, as in pretraining
        # (train/master.py), not autocast's cast of every weight and of every row's weight gradients. The
        # engine's replica holds exactly those bf16 weights: it is their storage.
        self.master_weights = None
        if self.compute_dtype == torch.bfloat16 and not self.sharded and can_use_master_weights(policy):
            self.master_weights = MasterWeights(policy, copies=self.engine_model)
        schedule = TrainConfig(preset="tiny", lr=cfg.lr, min_lr=cfg.lr, warmup=cfg.warmup, steps=cfg.steps * cfg.mu,
                               weight_decay=cfg.weight_decay, betas=(0.9, 0.99))  # constant after warmup
        self.optimizer, self.scheduler = build_optimizer(policy, schedule)
        self.rewards = RewardSet(list(cfg.rewards), list(cfg.reward_weights))
        self.prompt_stream = PromptStream(cfg.task_levels, cfg.seed, cfg.eval_prompts)
        self.loss_settings = LossSettings(cfg.loss_type, cfg.clip_low, cfg.clip_high, cfg.beta)
        block_size = 16
        self.rollout = Rollout(self.engine_model, tokenizer, EngineConfig(
            block_size=block_size, kv_cache_memory=cfg.kv_cache_memory,
            max_num_seqs=max(cfg.prompts_per_step * cfg.group_size, 1), max_num_batched_tokens=4096,
            compile=cfg.compile))
        self.moe_layers = policy.moe_layers()
        self.step_count = 0
        # Phase timings (Prometheus), on-demand traces, and from cfg.probe the monitor and dumps, as in
        # pretraining; phases here: rollout, rewards, backward, optimizer.
        self.probe = TrainingProbe.open(cfg.probe, [policy], [self.optimizer], self.out_dir)
        if reference is not None:
            reference.requires_grad_(False).eval()
            self._park(reference)

    # ------------------------------------------------------------------ state
    def save(self) -> Path:
        return save_checkpoint(self.out_dir / "checkpoints", self.step_count, self.policy, self.optimizer,
                               self.scheduler, self.prompt_stream, keep=self.cfg.keep_checkpoints)

    def resume(self, path: str | Path | None = None) -> bool:
        path = path or latest_checkpoint(self.out_dir / "checkpoints", self.cfg.checkpoint_fallback)
        if path is None:
            return False
        self.step_count = load_checkpoint(path, self.policy, self.optimizer, self.scheduler, self.prompt_stream)
        follow_schedule(self.optimizer, self.scheduler, self.cfg.lr)
        self._weights_updated()
        return True

    def _weights_updated(self) -> None:
        """The engine serves the policy's current weights: shared tensors already are (only the prefix
        cache goes); a replica gets them copied in place (an FSDP policy's shards gathered, cast to
        the replica's dtype)."""
        if self.sharded:
            self._sync_replica()
        elif self.engine_model is not self.policy:
            with torch.no_grad():
                replica = dict(self.engine_model.named_parameters())
                for name, param in self.policy.named_parameters():
                    replica[name].copy_(plain_tensor(param))
        self.rollout.weights_updated()

    def _sync_replica(self) -> None:
        """FSDP shards → every rank's full replica in the engine's dtype, by the resharding planner and
        its point-to-point executor (parallel/transfer.py): each rank receives only the boxes it lacks,
        in batched rounds, instead of an all-gather per parameter. The layouts never change, so the
        plan is made once."""
        from seekforge.parallel.layout import layout_of_model
        from seekforge.parallel.reshard import plan_reshard
        from seekforge.parallel.transfer import execute, shards_of

        if self._replica_plan is None:
            src, dst = layout_of_model(self.policy), layout_of_model(self.engine_model)
            self._replica_plan = plan_reshard(src, dst), {name: t.dtype for name, t in src.tensors.items()}
        plan, dtypes = self._replica_plan
        execute(plan, dtypes, shards_of(self.policy), shards_of(self.engine_model))

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
    def _seeds(self, step: int, count: int) -> list[int]:
        # disjoint per (step, prompt) streams; completion j of prompt i draws from seed + j
        return [(self.cfg.seed * 1_000_003 + step * 10_007 + i) * self.cfg.group_size for i in range(count)]

    def step(self) -> dict:
        cfg, tok, G = self.cfg, self.tokenizer, self.cfg.group_size
        step = self.step_count
        samples = self.prompt_stream.prompts(step, cfg.prompts_per_step)
        prompt_ids = [encode_prompt(tok, p) for p, _ in samples]
        seeds = self._seeds(step, len(samples))
        # Rollout: this rank's prompts; before generating, a prompt's expected work is its prompt
        # tokens plus the completion budget.
        mine = self._my_groups([G * (len(p) + cfg.max_new_tokens) for p in prompt_ids])
        self.probe.begin_step(step + 1, record=False)  # the dump and monitor watch training, not rollouts
        start = time.perf_counter()
        local = self.rollout.generate([prompt_ids[i] for i in mine], G, cfg.max_new_tokens, cfg.temperature,
                                      [seeds[i] for i in mine])
        rollout_time = time.perf_counter() - start
        if cfg.swap:
            self.rollout.sleep()
        self.probe.mark("rollout")
        self.probe.start_recording(step + 1)

        start = time.perf_counter()
        texts = [tok.decode(c) for c in local]
        prompts_text = [samples[i][0] for i in mine for _ in range(G)]
        metas = [{"answer": samples[i][1]} for i in mine for _ in range(G)]
        local_rewards, metrics = self.rewards.scores(prompts_text, texts, metas)
        # Every rank learns every group's completions and rewards (token ids: small), so advantages are
        # over whole groups and the training split can follow the actual sequence lengths.
        completions, rewards, metrics = _all_groups(mine, local, local_rewards, metrics, len(samples), G)
        advantages = group_advantages(rewards, G, cfg.scale_rewards)
        group_tokens = [sum(len(prompt_ids[g]) + len(c) for c in completions[g * G:(g + 1) * G])
                        for g in range(len(samples))]
        seqs = [g * G + j for g in self._my_groups(group_tokens) for j in range(G)]  # this rank trains these
        rows = pack_sequences([prompt_ids[i // G] for i in seqs], [completions[i] for i in seqs],
                              cfg.max_pack_tokens, cfg.max_pack_count)
        if uses_onednn(self.device, self.compute_dtype):  # row lengths from a small set: kernels built once
            rows = [pad_row(row, onednn_size(row.input_ids.shape[1])) for row in rows]
        if self.sharded:  # FSDP: every rank runs as many forwards (its collectives)
            rows += [empty_row()] * (_max_over_ranks(len(rows)) - len(rows))
        lengths = [len(c) for c in completions]
        with self._autocast():
            old = sequence_log_probs(self.policy, rows, len(seqs)) if cfg.mu > 1 else None
        ref = None
        if cfg.beta > 0:
            self._unpark(self.reference)
            with self._autocast():
                ref = sequence_log_probs(self.reference, rows, len(seqs))
            self._park(self.reference)
        batch = TrainingBatch([lengths[i] for i in seqs], advantages[seqs], old, ref)
        totals = BatchTotals(len(completions), sum(lengths), cfg.max_new_tokens)
        self._unpark(self.optimizer)
        self.policy.train()
        self.probe.mark("rewards")  # rewards, advantages, packing, old and reference log-probs
        for update in range(cfg.mu):
            with self._autocast():
                sums = accumulate_gradients(self.policy, rows, batch, totals, self.loss_settings, self._compute_weights)
            if not self.sharded:  # under FSDP the reduce-scatter already summed them
                _sum_gradients_over_ranks(self.policy)
            grad_norm = clip_grad_norm(list(self.policy.parameters()), cfg.clip_grad or math.inf)
            self.probe.mark("backward")
            if update == cfg.mu - 1:  # the monitor records the iteration's last optimizer step
                self.probe.before_optimizer(step + 1, grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.probe.mark("optimizer")
        for moe in self.moe_layers:  # the routing bias stays as pretrained; the counts are not used
            moe.tokens_per_expert.zero_()
        self._park(self.optimizer)
        self._weights_updated()
        train_time = time.perf_counter() - start
        self.step_count += 1
        self.prompt_stream.position = self.step_count

        sums = _sum_over_ranks(sums)
        by_group = rewards.view(-1, G)
        num_tokens = sum(len(prompt_ids[i // G]) + lengths[i] for i in range(len(completions)))
        metrics.update(
            reward_mean=rewards.mean().item(), reward_std=rewards.std().item(),
            zero_std_groups=(by_group.std(dim=1) == 0).float().mean().item(),
            loss=sums["loss"], clip_fraction=sums["clipped"], entropy=sums["entropy"], grad_norm=grad_norm.item(),
            response_length=sum(lengths) / len(lengths), lr=self.scheduler.get_last_lr()[0],
            rollout_tokens_per_s=sum(lengths) / rollout_time, train_tokens_per_s=num_tokens * cfg.mu / train_time,
            rollout_time_s=rollout_time, train_time_s=train_time, packed_rows=len(rows))
        if cfg.beta > 0:
            metrics["kl"] = sums["kl"]
        self.probe.end_step(self.step_count, metrics)
        return metrics

    def _my_groups(self, group_work: list[int]) -> list[int]:
        if not _distributed():
            return list(range(len(group_work)))
        return balance_groups(group_work, dist.get_world_size())[dist.get_rank()]

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out accuracy: greedy completions of the fixed held-out prompts, graded by the task."""
        eval_set = self.prompt_stream.eval_set
        if not eval_set:
            return float("nan")
        if _distributed():  # every rank grades its slice
            eval_set = eval_set[dist.get_rank()::dist.get_world_size()]
        ids = [encode_prompt(self.tokenizer, p) for p, _ in eval_set]
        completions = self.rollout.generate(ids, 1, self.cfg.max_new_tokens, temperature=0.0) if ids else []
        correct = [check_answer(self.tokenizer.decode(c), a) for c, (_, a) in zip(completions, eval_set, strict=True)]
        if self.cfg.swap:
            self.rollout.sleep()
        return _sum_over_ranks({"correct": float(sum(correct))})["correct"] / len(self.prompt_stream.eval_set)

    # ------------------------------------------------------------------ the loop
    def fit(self, stop_at: int | None = None, progress: bool = True) -> list[dict]:
        """Iterate until cfg.steps (or `stop_at`). Held-out accuracy at the start, every eval_interval
        steps and at the end. Returns this call's per-step metrics (also in metrics.jsonl)."""
        cfg = self.cfg
        end = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
        logger = MetricsLogger(self.out_dir, enabled=_is_main())
        progress = progress and _is_main()
        if self.step_count == 0 and cfg.eval_prompts:
            logger.log(0, {"eval_accuracy": self.evaluate()})
        history = []
        bar = tqdm(total=cfg.steps, initial=self.step_count, unit="step", dynamic_ncols=True, disable=not progress)
        while self.step_count < end:
            metrics = self.step()
            last = self.step_count == cfg.steps
            if cfg.eval_prompts and (last or (cfg.eval_interval and self.step_count % cfg.eval_interval == 0)):
                metrics["eval_accuracy"] = self.evaluate()
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


# ---------------------------------------------------------------------------------------- data parallel
# Under torchrun every rank holds a full replica of the policy and its own engine; the policy's
# gradients are summed over ranks (the loss weights already divide by the global totals).


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _all_groups(mine: list[int], completions: list[list[int]], rewards: list[float], metrics: dict,
                num_groups: int, group_size: int) -> tuple[list[list[int]], torch.Tensor, dict]:
    """This rank's groups' completions and rewards → every group's, in global order, and the reward
    metrics over all ranks (means weighted by samples, errors summed)."""
    pieces = [(mine, completions, rewards, metrics)]
    if _distributed():
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, (mine, completions, rewards, metrics))
    all_completions: list = [None] * (num_groups * group_size)
    all_rewards = torch.zeros(num_groups * group_size)
    for groups, comps, rews, _ in pieces:
        for k, g in enumerate(groups):
            for j in range(group_size):
                all_completions[g * group_size + j] = comps[k * group_size + j]
                all_rewards[g * group_size + j] = rews[k * group_size + j]
    total = sum(len(p[1]) for p in pieces)
    merged = {key: (sum(p[3][key] for p in pieces) if key == "reward_errors"
                    else sum(p[3][key] * len(p[1]) for p in pieces) / total) for key in metrics}
    return all_completions, all_rewards, merged


def _sum_gradients_over_ranks(model) -> None:
    """A routed expert may get tokens on one rank only: it gets a (zero) gradient everywhere iff some
    rank has one, so the reductions line up and AdamW skips exactly what one process would skip."""
    if not _distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    for p, any_rank in zip(params, has_grad.tolist(), strict=True):
        if any_rank:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def shard_policy(policy) -> None:
    """FSDP2 over all ranks, gradients summed rather than averaged: the loss weights already divide by
    the global batch totals (rl/algorithm.BatchTotals)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    device_type = policy.embed_tokens.weight.device.type
    apply_fsdp(policy, init_device_mesh(device_type, (dist.get_world_size(),)), MixedPrecisionPolicy())
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def _max_over_ranks(value: int) -> int:
    if not _distributed():
        return value
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    if not _distributed():
        return values
    names = sorted(values)
    summed = torch.tensor([values[n] for n in names], dtype=torch.float64)
    dist.all_reduce(summed)
    return dict(zip(names, summed.tolist(), strict=True))
