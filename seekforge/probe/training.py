"""The probe in the pretraining loop: what train/trainer.py calls, in this order, each step:

    begin_step(step) · mark("data") · mark("forward") · mark("backward") (per micro-batch)
    · before_optimizer(grad_norm) · mark("optimizer") · end_step(step, metrics)

Under expert parallelism the step's all-to-all waits (counted by parallel/ep.py's dispatcher) are
reported as the phase "communication_wait" too; they are part of the forward time, shown apart.

Always on: the phase timer and the on-demand tracer (SIGUSR2 or the trigger file
OUT/probe/trace_request). From a probe config file (TrainConfig.probe, `--probe FILE`): a dump of
chosen steps (`dump`), the monitor (`monitor`), and a metrics port (`trace.port`).
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from seekforge.probe.config import ProbeConfig, load_probe_config
from seekforge.probe.dump import Dumper, current_rank, module_classes, write_dump
from seekforge.probe.monitor import Monitor
from seekforge.probe.trace import MetricsServer, OnDemandTracer, StepTimer


class TrainingProbe:
    def __init__(self, cfg: ProbeConfig, modules: list, optimizers: list, out_dir: str | Path):
        """modules: the trained nn.Modules (one, or this rank's pipeline stages) and their optimizers."""
        self.rank = current_rank()
        self.dir = Path(out_dir) / "probe"
        self.registry = CollectorRegistry()
        self.timer = StepTimer(self.registry, "seekforge_train")
        self.tracer = OnDemandTracer(self.dir / "traces", self.rank, cfg.trace.steps, self.dir / "trace_request")
        if cfg.trace.signal:
            self.tracer.install_signal()
        self.server = MetricsServer(cfg.trace.port, self.registry, self.tracer) if cfg.trace.port is not None else None
        self.dumpers = [Dumper(m, cfg.dump, self.rank) for m in modules] if cfg.dump else []
        self.dump_root = self.dir / cfg.dump.out_dir if cfg.dump else None  # an absolute out_dir stays as is
        self._dumping: list[Dumper] = []
        if cfg.monitor and len(modules) != 1:
            raise ValueError("probe monitor watches one model; with pipeline stages (pp > 1) remove the `monitor` "
                             "table from the probe config")
        self.monitor = Monitor(modules[0], optimizers[0], cfg.monitor, self.dir, self.rank) if cfg.monitor else None
        self.dispatchers = [m.dispatcher for module in modules for m in module.modules()
                            if hasattr(getattr(m, "dispatcher", None), "wait_seconds")]  # expert-parallel MoE

    @classmethod
    def open(cls, path: str, modules: list, optimizers: list, out_dir: str | Path) -> TrainingProbe:
        """From a probe config file, or the always-on defaults when `path` is empty."""
        return cls(load_probe_config(path) if path else ProbeConfig(), modules, optimizers, out_dir)

    def begin_step(self, step: int, record: bool = True) -> None:
        """record=False: the module hooks (dump, monitor) wait for `start_recording` — GRPO first runs
        its rollouts through the same module, which is not the training pass they watch."""
        self.tracer.begin_step(step)
        for dispatcher in self.dispatchers:  # its all-to-all counters cover one step
            dispatcher.sent_bytes, dispatcher.wait_seconds, dispatcher.cross_node_bytes = 0, 0.0, 0
        if record:
            self.start_recording(step)
        self.timer.begin()

    def start_recording(self, step: int) -> None:
        self._dumping = [d for d in self.dumpers if d.start(step)]
        if self.monitor:
            self.monitor.begin_step(step)

    def mark(self, phase: str) -> None:
        self.timer.mark(phase)

    def before_optimizer(self, step: int, grad_norm) -> None:
        if self.monitor:
            self.monitor.before_optimizer(step, grad_norm)

    def end_step(self, step: int, metrics: dict) -> None:
        if self.dispatchers:
            self.timer.add("communication_wait", sum(d.wait_seconds for d in self.dispatchers))
        self.timer.end()
        for dumper in self._dumping:
            records, tensors = dumper.stop()
            write_dump(self.dump_root, step, self.rank, records, tensors, module_classes(dumper.model))
        if self.monitor:
            alerts = self.monitor.end_step(step, metrics)
            if alerts:
                metrics["probe_alerts"] = len(alerts)
        self.tracer.end_step(step)

    def close(self, step: int) -> None:
        self.tracer.close(step)
        if self.monitor:
            self.monitor.close()
        if self.server:
            self.server.close()
