"""Always-on step timing and on-demand profiler traces, for any loop made of steps (pretraining
steps, serving engine steps).

StepTimer: how long each phase of a step took (data, forward, backward, optimizer; "step" for a
loop that has one phase), as a Prometheus histogram `{prefix}_phase_seconds{phase=...}`.

OnDemandTracer: a `torch.profiler` Chrome trace of the next N steps, asked for while the loop runs —
`request(n)` from any thread (an HTTP handler), SIGUSR2, or a trigger file whose modification time
changes (`echo 5 > OUT/probe/trace_request`; its content, if a number, is N). Each rank writes its
own file DIR/trace_rank{R}_steps{A}-{B}.json, renamed into place when complete, so a reader never
sees half a file. Nothing happens between requests but a clock read and a stat per step.

MetricsServer: /metrics (Prometheus text) and POST /debug/trace?steps=N (the same route as
`seekforge serve`) on one port, in a daemon thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import torch
from prometheus_client import CollectorRegistry, Histogram, generate_latest

log = logging.getLogger("seekforge.probe")
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class StepTimer:
    def __init__(self, registry: CollectorRegistry, prefix: str):
        self.phases = Histogram(f"{prefix}_phase_seconds", "Seconds per step spent in each phase", ["phase"],
                                buckets=_BUCKETS, registry=registry)
        self._last = time.perf_counter()
        self._totals: dict[str, float] = {}

    def begin(self) -> None:
        self._last, self._totals = time.perf_counter(), {}

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or begin) was spent in `phase`; repeated phases (micro-
        batches) add up within the step."""
        now = time.perf_counter()
        self._totals[phase] = self._totals.get(phase, 0.0) + now - self._last
        self._last = now

    def add(self, phase: str, seconds: float) -> None:
        """Time measured elsewhere (e.g. communication waits inside forward), reported as its own phase."""
        self._totals[phase] = self._totals.get(phase, 0.0) + seconds

    def end(self) -> dict[str, float]:
        for phase, seconds in self._totals.items():
            self.phases.labels(phase=phase).observe(seconds)
        return self._totals


class OnDemandTracer:
    def __init__(self, out_dir: str | Path, rank: int = 0, default_steps: int = 3,
                 trigger_file: str | Path | None = None):
        self.out_dir, self.rank, self.default_steps = Path(out_dir), rank, default_steps
        self.trigger_file = Path(trigger_file) if trigger_file else None
        self._trigger_mtime = self._mtime()  # a file left from an earlier run is not a request
        self._requested = 0  # steps asked for and not yet started; written by other threads
        self._lock = threading.Lock()
        self._profiler = None
        self._remaining = 0
        self._first_step = 0
        self.written: list[Path] = []

    def request(self, steps: int | None = None) -> int:
        steps = self.default_steps if steps is None else steps
        if steps < 1:
            raise ValueError(f"steps={steps}: ask for at least one step to trace")
        with self._lock:
            self._requested = max(self._requested, steps)
        return steps

    def install_signal(self) -> bool:
        """SIGUSR2 → request(); only the main thread may install handlers (False elsewhere)."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR2"):
            return False
        signal.signal(signal.SIGUSR2, lambda *_: self.request())
        return True

    def _mtime(self) -> float | None:
        try:
            return self.trigger_file.stat().st_mtime if self.trigger_file else None
        except FileNotFoundError:
            return None

    def _poll_trigger(self) -> None:
        mtime = self._mtime()
        if mtime is not None and mtime != self._trigger_mtime:
            self._trigger_mtime = mtime
            text = self.trigger_file.read_text().strip()
            self.request(int(text) if text.isdigit() else None)

    def begin_step(self, step: int) -> None:
        if self._profiler is not None:
            return
        self._poll_trigger()
        with self._lock:
            steps, self._requested = self._requested, 0
        if steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
            self._remaining, self._first_step = steps, step
            log.info("probe: tracing steps %d-%d", step, step + steps - 1)

    def end_step(self, step: int) -> Path | None:
        """Returns the trace file when this step completed one."""
        if self._profiler is None:
            return None
        self._remaining -= 1
        if self._remaining > 0:
            return None
        return self._finish(step)

    def _finish(self, step: int) -> Path:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace_rank{self.rank}_steps{self._first_step}-{step}.json"
        partial = path.with_suffix(".json.partial")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, path)
        self.written.append(path)
        log.info("probe: trace written to %s", path)
        return path

    def close(self, step: int) -> None:
        """A trace still running when the loop ends is written with the steps it has."""
        if self._profiler is not None:
            self._finish(step)

    def wrap(self, fn, timer: StepTimer | None = None):
        """fn as one traced (and timed) step; for loops that are a repeated call, e.g. engine.step."""
        counter = [0]

        def step(*args, **kwargs):
            counter[0] += 1
            self.begin_step(counter[0])
            if timer is not None:
                timer.begin()
            try:
                return fn(*args, **kwargs)
            finally:
                if timer is not None:
                    timer.mark("step")
                    timer.end()
                self.end_step(counter[0])
        return step


class MetricsServer:
    """GET /metrics and POST /debug/trace?steps=N on `port` (0: any free port; see .port)."""

    def __init__(self, port: int, registry: CollectorRegistry, tracer: OnDemandTracer, host: str = "127.0.0.1"):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if urlparse(self.path).path != "/metrics":
                    return self._reply(404, b"not found: GET /metrics or POST /debug/trace?steps=N\n")
                self._reply(200, generate_latest(registry), "text/plain; version=0.0.4")

            def do_POST(self):
                url = urlparse(self.path)
                if url.path != "/debug/trace":
                    return self._reply(404, b"not found: GET /metrics or POST /debug/trace?steps=N\n")
                try:
                    steps = tracer.request(int(parse_qs(url.query)["steps"][0]) if "steps" in url.query else None)
                except ValueError as e:
                    return self._reply(400, f"{e}\n".encode())
                self._reply(202, f"tracing the next {steps} steps into {tracer.out_dir}\n".encode())

            def _reply(self, status: int, body: bytes, kind: str = "text/plain"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # no access log on stderr
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="seekforge-probe-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
