"""Training-state monitor: per step and per chosen module, the activation and output-gradient norms
(from statistics-mode dump hooks), weight-gradient norms, Adam moment norms, the update/weight ratio,
each MoE layer's expert loads and, under expert parallelism, its all-to-all traffic (bytes sent to
other ranks, seconds forward waited on the exchange; parallel/ep.py counts them); anomaly rules that
raise alerts and write that step's module statistics as a dump (readable by `seekforge probe
compare/report`).

Per step (the trainer calls these, see probe/training.py):
    begin_step(step)            arm the hooks
    before_optimizer(grad_norm) gradients, expert loads, a weight snapshot — all gone after the step
    end_step(step, metrics)     optimizer state, update ratio, rules, records
Written under OUT/probe/: monitor_rank{R}.jsonl (every `interval` steps), alerts_rank{R}.jsonl, and
anomaly_dumps/step{S}/rank{R}/ on an alert. Norms of sharded (DTensor) weights are this rank's shard's.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from pathlib import Path

import torch
from torch import nn

from seekforge.model.moe import MoE
from seekforge.probe.config import DumpConfig, MonitorConfig
from seekforge.probe.dump import Dumper, local, module_classes, write_dump

log = logging.getLogger("seekforge.probe")


def norm_of(tensors: list[torch.Tensor]) -> float:
    """L2 norm over a list of tensors (0.0 for none); one fused multi-tensor kernel, as clip_grad_norm_."""
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm([local(t) for t in tensors]))))


def spike(value: float, history: deque, factor: float, min_history: int) -> bool:
    """value > factor × the mean of the finite values seen before (once there are min_history)."""
    return len(history) >= min_history and value > factor * (sum(history) / len(history))


class Monitor:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: MonitorConfig, out_dir: str | Path,
                 rank: int = 0):
        self.model, self.optimizer, self.cfg, self.rank = model, optimizer, cfg, rank
        self.out_dir = Path(out_dir)
        self.dumper = Dumper(model, DumpConfig(mode="statistics", modules=cfg.modules, slots=["output"]), rank)
        self.watched = self.dumper.targets  # (name, module)
        self.moe = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
        self.losses: deque = deque(maxlen=cfg.window)
        self.grad_norms: deque = deque(maxlen=cfg.window)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._records = open(self.out_dir / f"monitor_rank{rank}.jsonl", "a")
        self._alerts = open(self.out_dir / f"alerts_rank{rank}.jsonl", "a")
        self._tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        self._step_state: dict = {}

    def _recording(self, step: int) -> bool:
        return step % self.cfg.interval == 0

    def begin_step(self, step: int) -> None:
        # Hooks every step when an anomaly may need this step's statistics, else on recorded steps only.
        if self.cfg.dump_on_anomaly or self._recording(step):
            self.dumper.start(step)

    @torch.no_grad()
    def before_optimizer(self, step: int, grad_norm: torch.Tensor) -> None:
        state = {"grad_norm": float(grad_norm)}
        if self._recording(step):
            state["weight_grad_norm"] = {name: norm_of([p.grad for p in m.parameters() if p.grad is not None])
                                         for name, m in self.watched}
            state["weights_before"] = {name: [local(p).detach().clone() for p in m.parameters()]
                                       for name, m in self.watched}
            state["expert_load"] = {name: m.tokens_per_expert.tolist() for name, m in self.moe}
            state["all_to_all"] = {name: {"sent_bytes": m.dispatcher.sent_bytes, "wait_s": m.dispatcher.wait_seconds}
                                   for name, m in self.moe if hasattr(m.dispatcher, "sent_bytes")}
        self._step_state = state

    @torch.no_grad()
    def end_step(self, step: int, metrics: dict) -> list[dict]:
        """Returns this step's alerts ({"step", "rule", "value", "detail"})."""
        records, _ = self.dumper.stop() if self.dumper.handles else ([], {})
        state, self._step_state = self._step_state, {}
        loss = float(metrics.get("loss", math.nan))
        grad_norm = state.get("grad_norm", float(metrics.get("grad_norm", math.nan)))
        alerts = self._check(step, loss, grad_norm, records)
        if alerts and self.cfg.dump_on_anomaly and records:
            path = write_dump(self.out_dir / "anomaly_dumps", step, self.rank, records, {}, module_classes(self.model))
            for alert in alerts:
                alert["dump"] = str(path)
        for alert in alerts:
            log.warning("probe alert at step %d: %s (%s) %s", step, alert["rule"], alert["value"], alert["detail"])
            self._alerts.write(json.dumps(alert) + "\n")
        self._alerts.flush()
        if self._recording(step):
            self._write(step, loss, grad_norm, records, state)
        return alerts

    def _check(self, step: int, loss: float, grad_norm: float, records: list[dict]) -> list[dict]:
        alerts = []
        cfg = self.cfg
        nonfinite = [r for r in records
                     if any((s.get("nan") or 0) + (s.get("inf") or 0) for s in r["tensors"].values())]
        if not math.isfinite(loss) or not math.isfinite(grad_norm) or nonfinite:
            first = min(nonfinite, key=lambda r: (r["direction"] != "forward", r["order"]), default=None)
            detail = f"first non-finite: {first['module']} ({first['direction']})" if first else ""
            alerts.append({"step": step, "rule": "nan_inf", "value": [loss, grad_norm], "detail": detail})
        if math.isfinite(loss) and spike(loss, self.losses, cfg.loss_spike_factor, cfg.min_history):
            alerts.append({"step": step, "rule": "loss_spike", "value": loss,
                           "detail": f"running mean {sum(self.losses) / len(self.losses):.4g}"})
        if math.isfinite(grad_norm) and spike(grad_norm, self.grad_norms, cfg.grad_spike_factor, cfg.min_history):
            alerts.append({"step": step, "rule": "grad_spike", "value": grad_norm,
                           "detail": f"running mean {sum(self.grad_norms) / len(self.grad_norms):.4g}"})
        # Only finite, unflagged values enter the running means: a spike must not raise the bar for the next.
        if math.isfinite(loss) and not any(a["rule"] == "loss_spike" for a in alerts):
            self.losses.append(loss)
        if math.isfinite(grad_norm) and not any(a["rule"] == "grad_spike" for a in alerts):
            self.grad_norms.append(grad_norm)
        return alerts

    def _write(self, step: int, loss: float, grad_norm: float, records: list[dict], state: dict) -> None:
        modules: dict[str, dict] = {name: {} for name, _ in self.watched}
        for r in records:
            key = "activation_norm" if r["direction"] == "forward" else "output_grad_norm"
            norms = [s["norm"] for slot, s in r["tensors"].items() if slot.endswith(".0") and s["norm"] is not None]
            if norms:  # repeated calls (micro-batches, a shared head): root of the summed squares
                modules[r["module"]][key] = math.hypot(modules[r["module"]].get(key, 0.0), norms[0])
        for name, module in self.watched:
            entry = modules[name]
            entry["weight_grad_norm"] = state.get("weight_grad_norm", {}).get(name)
            params = list(module.parameters())
            moments = [self.optimizer.state.get(p, {}) for p in params]
            entry["exp_avg_norm"] = norm_of([m["exp_avg"] for m in moments if "exp_avg" in m])
            entry["exp_avg_sq_norm"] = norm_of([m["exp_avg_sq"] for m in moments if "exp_avg_sq" in m])
            before = state.get("weights_before", {}).get(name)
            if before:
                update = norm_of(torch._foreach_sub([local(p).detach() for p in params], before))
                entry["update_ratio"] = update / max(norm_of(before), 1e-12)
        row = {"step": step, "loss": loss, "grad_norm": grad_norm, "modules": modules,
               "expert_load": state.get("expert_load", {}), "all_to_all": state.get("all_to_all", {})}
        self._records.write(json.dumps(row) + "\n")
        self._records.flush()
        if self._tb is not None:
            for name, entry in modules.items():
                for key, value in entry.items():
                    if value is not None:
                        self._tb.add_scalar(f"{key}/{name}", value, step)

    def close(self) -> None:
        if self.dumper.handles:
            self.dumper.stop()
        self._records.close()
        self._alerts.close()
        if self._tb is not None:
            self._tb.close()
