"""The pretraining loop on an already-built (and possibly already-parallelized) model.

One optimizer step = `grad_accum` micro-batches of forward (bf16 where the hardware runs bf16 fast,
fp32 elsewhere: model/precision.py; under bf16 the matmul weights are persistent bf16 copies of fp32
master weights, train/master.py, with autocast casting the activations) and backward on the objective
of model/loss.py (lm + λ·mtp; each MoE layer adds its balance loss to its own backward), a global
grad-norm clip, AdamW, the LR schedule, then the aux-loss-free expert-bias update from that step's
global expert loads.

Distributed seam: nothing here builds parallelism; the model arrives parallelized (parallel/
parallelize) and the loader yields this data-parallel rank's slice of the global batch. With a
`mesh`, the loss runs under TP's loss context, expert loads are summed over the data-parallel
ranks before the bias update, logged losses are their mean (the single-device loss of the global
batch), only rank 0 logs, and checkpoints are DCP (each rank writes its shards). Under context
parallelism (a mesh with a cp dimension) the cp ranks of a data-parallel rank get the same rows, each
forwards its chunks and scores its share of the loss (parallel/cp.py), the shares × cp enter the rank
mean, and the expert loads are summed over dp × cp.

On the GPU path (model/gpu: CUDA) a step never waits for the device: its metrics stay device tensors
(`train_step` returns them so) and `fit` reads them on logging steps only — those that print a log line,
evaluate, save a checkpoint or end the run — all the steps since the last one in one device→host copy
(`read_metrics`); their tokens/s, step time and MFU are then the window's mean (a step's own wall time
would measure only how fast the host queued its kernels). metrics.jsonl gets every step's line, written
at those steps (a probe monitor, when one is configured, reads the loss every step: a sync each). On a CPU
the step reads its metrics itself (a copy there costs nothing): one record a step, as before.

Pipeline parallelism: `model` is then a PipelineRunner (parallel/pp.py). Each of this rank's stages
has its own optimizer (checkpoint names stay per stage), the schedule runs forward and backward of
every micro-batch with the same objective, the grad norm and the balance loss add up over the pipeline
ranks, and the loss parts and the held-out loss come from the last stage.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from seekforge.config import TrainConfig
from seekforge.model.dtensor import plain_tensor
from seekforge.model.gpu import gpu_path
from seekforge.model.loss import lm_loss
from seekforge.model.moe import MoE
from seekforge.model.precision import resolve_dtype
from seekforge.parallel import cp
from seekforge.parallel.cp import data_group
from seekforge.parallel.overlap import accumulate, check_supported, create_lanes, expert_groups, fsdp_unsharded
from seekforge.parallel.parallelize import compile_blocks
from seekforge.parallel.recompute import apply_recompute
from seekforge.parallel.tp import loss_context
from seekforge.probe.training import TrainingProbe
from seekforge.train.balance import update_expert_bias
from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from seekforge.train.flops import flops_per_token, measure_peak_flops, model_flops_utilization
from seekforge.train.master import MasterWeights, can_use_master_weights
from seekforge.train.metrics import MetricsLogger, plot_loss_curve
from seekforge.train.optim import build_optimizer, clip_grad_norm, follow_schedule
from seekforge.train.watchdog import collective_failure


def prepare_model(model, cfg: TrainConfig):
    """Single-device path: recompute, then compile each block — the order parallel/ applies them in
    (a parallelized model arrives with both already done)."""
    if cfg.recompute != "none":
        apply_recompute(model, cfg.recompute)
    if cfg.compile:
        compile_blocks(model)
    return model


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class Trainer:
    def __init__(self, cfg: TrainConfig, model, loader, eval_batches: list[dict] | None = None,
                 out_dir: str | Path | None = None, mesh=None, baseline: float | None = None):
        """model: a (parallelized) Transformer, or a PipelineRunner holding this rank's stages;
        loader: an iterable of batch dicts with state_dict()/load_state_dict() (data/BatchLoader)
        whose iter() continues from its current state (what exact resume relies on); under data
        parallelism it yields this rank's slice (B / dp, T) of each global batch (B, T);
        mesh: the ParallelMesh the model was parallelized over (parallel/mesh.py), None on one device;
        eval_batches: fixed held-out batches, so evaluations are comparable across steps and resumes;
        baseline: the corpus unigram entropy, drawn on the loss plot."""
        self.cfg, self.model, self.loader = cfg, model, loader
        self.eval_batches = eval_batches or []
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.dp_group = data_group(mesh) if mesh is not None else None  # dp (× cp): expert loads summed over it
        self.tp_mesh = mesh["tp"] if mesh is not None else None
        # Context parallelism: every cp rank holds its chunks of the same rows (parallel/cp.py).
        self.cp_mesh = mesh["cp"] if mesh is not None and "cp" in mesh.batch.mesh_dim_names else None
        self.baseline = baseline
        self.is_main = not _distributed() or dist.get_rank() == 0
        self.runner = None if isinstance(model, nn.Module) else model  # a PipelineRunner is no Module
        self.modules = [model] if self.runner is None else self.runner.modules
        self.pp_group = mesh["pp"].get_group() if self.runner is not None else None
        # The last stage's copy of the embedding (for MTP) is a second copy of one weight: clipped, not counted.
        self.duplicates = {id(p) for m in self.modules if getattr(m, "is_last", False) and not m.is_first
                           and hasattr(m, "embed_tokens") for p in m.embed_tokens.parameters()}
        self.device = next(self.modules[0].parameters()).device
        built = [build_optimizer(m, cfg.optimizer_config()) for m in self.modules]
        self.optimizers, self.schedulers = [o for o, _ in built], [s for _, s in built]
        self.moe_layers = [m for module in self.modules for m in module.modules() if isinstance(m, MoE)]
        # Forward passes per optimizer step: gradient accumulation × pipeline micro-batches.
        self.forwards_per_step = cfg.grad_accum * (self.runner.pc.microbatches if self.runner else 1)
        # Under cp a rank's loss (its balance loss too) is its share, backwarded × cp where FSDP averages the
        # gradients over the cp ranks (cp.grad_scale); the shares × cp enter the logged rank mean.
        self.cp_grad_scale = 1 if self.cp_mesh is None else cp.grad_scale(self.modules[0], self.cp_mesh)
        self.cp_size = 1 if self.cp_mesh is None else self.cp_mesh.size()
        for moe in self.moe_layers:
            moe.aux_loss_coeff, moe.aux_grad_scale = cfg.aux_loss_coeff, self.cp_grad_scale / self.forwards_per_step
        model_cfg = self.modules[0].cfg
        # The same names on every rank (all-reduced together); ranks without the last stage send zeros.
        self.loss_names = ["loss", "lm_loss"]
        if cfg.mtp_loss_scale > 0 and model_cfg.num_nextn_predict_layers:
            self.loss_names.append("mtp_loss")
        if cfg.aux_loss_coeff > 0 and model_cfg.num_moe_layers:
            self.loss_names.append("aux_loss")
        self.ckpt_root = self.out_dir / "checkpoints"
        self.step = 0  # optimizer steps taken
        self.tokens_per_step = cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum  # global batch
        self.num_devices = dist.get_world_size() if _distributed() else 1
        self.flops_per_token = flops_per_token(model_cfg, cfg.seq_len, with_mtp=cfg.mtp_loss_scale > 0)
        self.compute_dtype, self.dtype_reason = resolve_dtype(cfg.dtype, self.device, model_cfg.hidden_size)
        # bf16 on one process: persistent bf16 matmul weights over the fp32 masters (train/master.py)
        # instead of autocast casting every weight each forward; sharded layouts use FSDP2's policy.
        self.master_weights = (MasterWeights(model) if self.compute_dtype == torch.bfloat16 and self.runner is None
                               and can_use_master_weights(model) else None)
        # The peak of the dtype the matmuls really run in: a bf16 probe on a CPU without native bf16
        # measures a small fraction of what fp32 training reaches (the MFU would read hundreds of percent).
        self.peak_flops = cfg.peak_flops or measure_peak_flops(self.compute_dtype, self.device)
        self._iterator = iter(loader)
        self.probe = TrainingProbe.open(cfg.probe, self.modules, self.optimizers, self.out_dir)
        if cfg.overlap:
            self._check_overlap()
            if _distributed():
                create_lanes(expert_groups(self.modules))

    # ------------------------------------------------------------------ state
    def resume(self, path: str | Path | None = None) -> bool:
        """Load `path` or the latest checkpoint under out_dir; False when there is none."""
        path = path or latest_checkpoint(self.ckpt_root, self.cfg.checkpoint_fallback)
        if path is None:
            return False
        self.step = load_checkpoint(path, self.modules, self.optimizers, self.schedulers[0], self.loader)
        for scheduler in self.schedulers[1:]:  # every stage follows the same schedule
            scheduler.load_state_dict(self.schedulers[0].state_dict())
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            follow_schedule(optimizer, scheduler, self.cfg.lr)
        self._iterator = iter(self.loader)
        return True

    def save(self) -> Path:
        return save_checkpoint(self.ckpt_root, self.step, self.modules, self.optimizers, self.schedulers[0],
                               self.loader, keep=self.cfg.keep_checkpoints)

    # ------------------------------------------------------------------ one step
    def _autocast(self):
        if self.compute_dtype == torch.bfloat16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _compute_weights(self):
        """The bf16 matmul weights for one forward + backward (train/master.py), where used."""
        return self.master_weights.compute() if self.master_weights is not None else nullcontext()

    def _next_batch(self) -> dict:
        try:
            batch = next(self._iterator)
        except StopIteration:  # a finite loader: start its next epoch
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        if self.device.type == "cuda":
            # A copy from pageable memory may wait for the device's queue to drain (CUDA stages it); from
            # pinned memory it never does. torch's caching host allocator reuses the pinned buffers.
            batch = {k: v if v.is_pinned() or v.device.type != "cpu" else v.pin_memory() for k, v in batch.items()}
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self) -> dict:
        """One optimizer step. Returns its metrics (losses averaged over micro-batches and ranks)."""
        cfg = self.cfg
        start = time.perf_counter()
        for module in self.modules:
            module.train()
        sums = dict.fromkeys(self.loss_names, torch.zeros((), device=self.device))
        self.probe.begin_step(self.step + 1)
        overlapped = cfg.overlap and cfg.grad_accum > 1 and self.runner is None
        if overlapped:
            sums = self._accumulate_overlapped(sums)
        for _ in range(0 if overlapped else cfg.grad_accum):
            batch = self._next_batch()
            self.probe.mark("data")
            if self.runner is not None:  # forward and backward of all pipeline micro-batches
                parts = self.runner.step(batch["input_ids"], batch["labels"], grad_scale=1 / cfg.grad_accum)
            else:
                with loss_context(self.tp_mesh), self._compute_weights():
                    with self._autocast():
                        loss, parts = self._loss(batch, cfg.mtp_loss_scale)
                    self.probe.mark("forward")
                    (loss * self.cp_grad_scale / cfg.grad_accum).backward()
                parts = {"loss": loss.detach(), **parts}
            self.probe.mark("backward")  # a pipeline's schedule: forward and backward together
            sums = self._add_parts(sums, parts)
        if self.runner is not None:
            self.runner.sync_tied_embedding_grads()
        if self.cp_mesh is not None:
            cp.reduce_grads(self.modules, self.cp_mesh)
        if "aux_loss" in sums:  # the balance loss is part of the step's loss, from every pipeline stage
            sums["aux_loss"] = self._take_aux_loss()
            sums["loss"] = sums["loss"] + sums["aux_loss"]
        max_norm = cfg.clip if cfg.clip > 0 else math.inf  # inf: measure the norm, clip nothing
        params = [p for module in self.modules for p in module.parameters()]
        grad_norm = clip_grad_norm(params, max_norm, self.pp_group, self.duplicates)
        self.probe.before_optimizer(self.step + 1, grad_norm)
        lr = self.optimizers[0].param_groups[0]["lr"]
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        self.probe.mark("optimizer")
        imbalance = update_expert_bias(self.moe_layers, cfg.bias_update_speed, self.dp_group)
        self.step += 1

        values = self._mean_over_loss_ranks([sums[n] for n in self.loss_names] + [grad_norm.float()])
        metrics = dict(zip(self.loss_names, values[:-1], strict=True))
        metrics.update(grad_norm=values[-1], lr=lr)
        if imbalance is not None:
            metrics["expert_imbalance"] = imbalance  # max/mean tokens per expert, per MoE layer
            metrics["expert_imbalance_max"] = imbalance.max()
        if not gpu_path(self.device):
            self.read_metrics([metrics], time.perf_counter() - start)
        self.probe.end_step(self.step, metrics)
        return metrics

    def _loss(self, batch: dict, mtp_loss_scale: float):
        """The objective on one micro-batch (model/loss.py); under context parallelism this cp rank's share of it."""
        if self.cp_mesh is None:
            return lm_loss(self.model, batch["input_ids"], batch["labels"], batch.get("positions"),
                           batch.get("segment_ids"), mtp_loss_scale)
        if "segment_ids" in batch:
            raise ValueError("context parallelism with packed documents (segment_ids) is not supported yet; "
                             "use cp=1 for such data")
        return cp.cp_lm_loss(self.model, batch["input_ids"], batch["labels"], self.cp_mesh, mtp_loss_scale)

    def _check_overlap(self) -> None:
        for name, sub_mesh in (("tp", self.tp_mesh), ("cp", self.cp_mesh)):  # their collectives inside the layers
            size = sub_mesh.size() if sub_mesh is not None else 1  # would come from both threads on one group
            if size > 1:
                raise ValueError(f"TrainConfig.overlap=True with {name}={size} is not supported (only the expert "
                                 f"exchanges get a lane per micro-batch); use {name}=1 or overlap=False")
        check_supported(self.modules, self.device, pipelined=self.runner is not None)
        if self.runner is not None:  # pipeline micro-batches overlap inside the schedule, not across grad_accum
            self.runner.overlap_f_b()
            return
        if self.master_weights is not None:
            raise ValueError("TrainConfig.overlap=True with bf16 on one process is not supported (its bf16 weight "
                             "copies span one forward and backward); use dtype='fp32' or overlap=False")

    def _accumulate_overlapped(self, sums: dict) -> dict:
        """The grad_accum micro-batches with each forward running beside the previous micro-batch's backward
        (cfg.overlap, parallel/overlap.py): the same gradients and loss sums as the sequential loop."""
        cfg, parts_of = self.cfg, []

        def forward(i: int) -> torch.Tensor:
            batch = self._next_batch()
            with self._autocast():
                loss, parts = self._loss(batch, cfg.mtp_loss_scale)
            parts_of.append({"loss": loss.detach(), **parts})
            return loss / cfg.grad_accum

        with loss_context(self.tp_mesh), fsdp_unsharded(self.model) as reduce:
            accumulate(cfg.grad_accum, forward, torch.Tensor.backward, reduce)
        self.probe.mark("backward")  # forward and backward together
        for parts in parts_of:
            sums = self._add_parts(sums, parts)
        return sums

    def _add_parts(self, sums: dict, parts: dict) -> dict:
        """One micro-batch's loss parts added into the step's means; under cp, a rank's share × cp (the ranks'
        values are averaged when logged)."""
        return {**sums, **{name: sums[name] + plain_tensor(value).float() * self.cp_size / self.cfg.grad_accum
                           for name, value in parts.items()}}

    def read_metrics(self, records: list[dict], seconds: float) -> list[dict]:
        """train_step's records of the steps that took `seconds` together, their device tensors read as floats
        (lists for per-layer values) in one device→host copy — the one sync of a logging step on the GPU path —
        and each given its share of the time: step_time_s, tokens_per_s and mfu. In place; returns `records`."""
        tensors = [(r, k) for r in records for k, v in r.items() if isinstance(v, torch.Tensor)]
        if tensors:
            flat = torch.cat([r[k].detach().reshape(-1).float() for r, k in tensors]).tolist()
            for r, k in tensors:
                n = r[k].numel()
                r[k], flat = (flat[0] if r[k].dim() == 0 else flat[:n]), flat[n:]
        elapsed = seconds / max(1, len(records))
        tokens_per_s = self.tokens_per_step / elapsed
        for r in records:  # the keys in the CPU path's order: the timing right after lr
            later = {k: r.pop(k) for k in list(r)[list(r).index("lr") + 1:]}
            r.update(tokens_per_s=tokens_per_s, step_time_s=elapsed, mfu=self._mfu(tokens_per_s), **later)
        return records

    def _take_aux_loss(self) -> torch.Tensor:
        """The mean over this step's forward passes of Σ_layers balance loss, reset for the next step;
        under a pipeline, summed over the stages' ranks."""
        total = torch.zeros((), device=self.device)
        for moe in self.moe_layers:
            total = total + moe.aux_loss
            moe.aux_loss = 0.0
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total * self.cp_size / self.forwards_per_step  # under cp: this rank's share × cp, as _add_parts

    def _mean_over_loss_ranks(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Scalars averaged over the ranks that hold the loss: every rank, or those of the last
        pipeline stage. TP replicas hold equal values, so this is the data-parallel mean. A device
        tensor (one all-reduce; no host sync)."""
        holds_loss = float(self.runner is None or self.runner.last is not None)
        values = torch.stack([v.to(self.device) for v in values] + [torch.ones((), device=self.device)]) * holds_loss
        if _distributed():
            dist.all_reduce(values)
        return values[:-1] / values[-1]

    def _mfu(self, tokens_per_s: float) -> float:
        achieved = tokens_per_s * self.flops_per_token / self.num_devices
        if achieved > self.peak_flops and not self.cfg.peak_flops:
            # The probe ran on a busier machine than this step did: probe again, and never report the
            # peak as lower than what a step just reached.
            self.peak_flops = max(achieved, measure_peak_flops(self.compute_dtype, self.device))
        return model_flops_utilization(achieved, self.peak_flops)

    def evaluate(self) -> float:
        """Mean lm loss over the fixed held-out batches. MoE token counts are restored afterwards:
        evaluation traffic must not steer the balancing bias."""
        if not self.eval_batches:
            return float("nan")
        saved_counts = [m.tokens_per_expert.clone() for m in self.moe_layers]
        for module in self.modules:
            module.eval()
        losses = []
        for batch in self.eval_batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            if self.runner is not None:
                parts = self.runner.evaluate(batch["input_ids"], batch["labels"])
            else:
                with torch.no_grad(), loss_context(self.tp_mesh), self._compute_weights(), self._autocast():
                    _, parts = self._loss(batch, mtp_loss_scale=0.0)
            losses.append(plain_tensor(parts["lm_loss"]).float() * self.cp_size if parts  # cp: a rank's share × cp
                          else torch.zeros((), device=self.device))
        for module in self.modules:
            module.train()
        for moe, counts in zip(self.moe_layers, saved_counts, strict=True):
            moe.tokens_per_expert.copy_(counts)
        return self._mean_over_loss_ranks([torch.stack(losses).mean()]).item()

    # ------------------------------------------------------------------ the loop
    def _guarded_step(self) -> dict:
        """train_step; under torch.distributed a failed collective becomes an error naming the rank(s)
        that hung or died (train/watchdog.py)."""
        if not _distributed():
            return self.train_step()
        try:
            return self.train_step()
        except RuntimeError as e:  # DistBackendError (timeouts, lost peers) is a RuntimeError
            raise collective_failure(e, self.step + 1, self.cfg.dist_timeout_s) from e

    def fit(self, stop_at: int | None = None) -> list[dict]:
        """Train until cfg.steps (or `stop_at`, to split a run in tests and time-boxed jobs).
        Returns the per-step metrics of this call."""
        cfg = self.cfg
        end = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
        logger = MetricsLogger(self.out_dir, enabled=self.is_main)
        history: list[dict] = []
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not self.is_main, unit="step",
                   dynamic_ncols=True, mininterval=1.0)
        window: list[dict] = []  # the steps of the next log line
        unread: list[dict] = []  # the steps whose metrics are still on the device (GPU path)
        since = time.perf_counter()
        while self.step < end:
            unread.append(self._guarded_step())
            evaluating = bool(cfg.eval_interval and self.step % cfg.eval_interval == 0) or self.step == cfg.steps
            log_line = bool(cfg.log_interval and (self.step % cfg.log_interval == 0 or self.step == end))
            saving = bool(cfg.save_interval and self.step % cfg.save_interval == 0 and self.step < end)
            if gpu_path(self.device):
                if not (log_line or evaluating or saving or self.step == end):
                    continue  # not a logging step: the host keeps queueing work
                self.read_metrics(unread, time.perf_counter() - since)
            if evaluating:
                unread[-1]["eval_loss"] = self.evaluate()
            for i, metrics in enumerate(unread):
                logger.log(self.step - len(unread) + 1 + i, metrics)
            history += unread
            window += unread
            bar.update(len(unread))
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                            mfu=f"{100 * metrics['mfu']:.1f}%", refresh=False)
            unread = []
            if self.is_main and log_line:
                bar.write(self._log_line(window, bar))
                window = []
            if saving:
                self.save()
            since = time.perf_counter()
        bar.close()
        self.probe.close(self.step)
        if history:  # the final (or interrupted) state is always saved
            self.save()
        logger.close()
        if self.is_main and logger.jsonl_path.exists():
            plot_loss_curve(logger.jsonl_path, self.out_dir / "loss.png", self.baseline)
        return history

    def _log_line(self, window: list[dict], bar) -> str:
        last = window[-1]
        tokens_per_s = sum(m["tokens_per_s"] * m["step_time_s"] for m in window) / sum(m["step_time_s"] for m in window)
        parts = [f"step {self.step:>5}/{self.cfg.steps}", f"loss {last['loss']:.4f}"]
        if "lm_loss" in last:
            parts.append(f"lm {last['lm_loss']:.4f}")
        if "mtp_loss" in last:
            parts.append(f"mtp {last['mtp_loss']:.4f}")
        if "eval_loss" in last:
            parts.append(f"eval {last['eval_loss']:.4f}")
        parts += [f"lr {last['lr']:.2e}", f"gnorm {last['grad_norm']:.2f}", f"{tokens_per_s:,.0f} tok/s",
                  f"MFU {100 * self._mfu(tokens_per_s):.1f}%"]
        if "expert_imbalance_max" in last:
            parts.append(f"imbalance {last['expert_imbalance_max']:.2f}")
        rate = bar.format_dict.get("rate")
        if rate:
            parts.append(f"eta {tqdm.format_interval((self.cfg.steps - self.step) / rate)}")
        return " | ".join(parts)
