"""probe/trace.py: on-demand profiler traces asked for while a loop runs (by call, HTTP, SIGUSR2 or
a trigger file) are valid Chrome traces, one per request, and the loop keeps going — a real
`seekforge pretrain` in a subprocess, and a live `seekforge serve` app."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from seekforge.config import EngineConfig, preset
from seekforge.model.model import build_model
from seekforge.model.tokenizer import load_tokenizer
from seekforge.probe.trace import MetricsServer, OnDemandTracer, StepTimer
from tests.serve.conftest import LiveServer, free_port


def assert_chrome_trace(path):
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert any(e.get("ph") == "X" for e in events), "no complete (duration) events"
    return events


def run_steps(tracer, timer, first, count):
    for step in range(first, first + count):
        tracer.begin_step(step)
        timer.begin()
        torch.randn(64, 64) @ torch.randn(64, 64)
        timer.mark("forward")
        timer.end()
        tracer.end_step(step)


def test_request_trigger_file_signal_and_http(tmp_path):
    registry = CollectorRegistry()
    timer = StepTimer(registry, "loop")
    trigger = tmp_path / "trace_request"
    trigger.write_text("")  # present before the tracer starts: not a request
    tracer = OnDemandTracer(tmp_path / "traces", trigger_file=trigger, default_steps=2)
    run_steps(tracer, timer, 1, 3)
    assert tracer.written == []
    tracer.request(3)
    run_steps(tracer, timer, 4, 4)
    assert [p.name for p in tracer.written] == ["trace_rank0_steps4-6.json"]
    assert_chrome_trace(tracer.written[0])
    os.utime(trigger, (time.time() + 5, time.time() + 5))
    trigger.write_text("1\n")
    run_steps(tracer, timer, 8, 2)
    assert tracer.written[-1].name == "trace_rank0_steps8-8.json"
    assert tracer.install_signal()
    os.kill(os.getpid(), signal.SIGUSR2)
    run_steps(tracer, timer, 10, 3)
    assert tracer.written[-1].name == "trace_rank0_steps10-11.json"  # default_steps=2
    server = MetricsServer(0, registry, tracer)
    try:
        url = f"http://127.0.0.1:{server.port}"
        assert httpx.post(f"{url}/debug/trace?steps=1").status_code == 202
        assert httpx.post(f"{url}/debug/trace?steps=0").status_code == 400
        run_steps(tracer, timer, 13, 1)
        assert tracer.written[-1].name == "trace_rank0_steps13-13.json"
        body = httpx.get(f"{url}/metrics").text
        assert 'loop_phase_seconds_count{phase="forward"} 13.0' in body
    finally:
        server.close()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    with pytest.raises(ValueError, match="at least one"):
        tracer.request(0)


def wait_for(condition, timeout: float, proc=None, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended (rc {proc.returncode}) while waiting for {what}: "
                                 f"{proc.stdout.read()[-2000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run):
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_pretrain_traces_on_request_and_keeps_training(tmp_path):
    port = free_port()
    (tmp_path / "probe.yaml").write_text(f"trace: {{port: {port}}}\n")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "seekforge", "pretrain", "--preset", "tiny", "--steps", "100000", "--seq-len", "32",
           "--micro-batch-size", "2", "--dtype", "fp32", "--out-dir", str(run), "--probe", str(tmp_path / "probe.yaml"),
           "--set", "eval_interval=0", "--set", "save_interval=0", "--set", "peak_flops=1e11",
           "--set", "export_hf=false", "--set", "sample_prompt=", "--set", "log_interval=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    traces = run / "probe" / "traces"
    try:
        wait_for(lambda: logged_steps(run) >= 3, 120, proc, "training steps")
        response = httpx.post(f"http://127.0.0.1:{port}/debug/trace?steps=2", timeout=10)
        assert response.status_code == 202
        first = wait_for(lambda: sorted(traces.glob("*.json")), 60, proc, "the HTTP-requested trace")
        assert_chrome_trace(first[0])
        os.kill(proc.pid, signal.SIGUSR2)
        both = wait_for(lambda: (lambda t: t if len(t) == 2 else None)(sorted(traces.glob("*.json"))), 60, proc,
                        "the signalled trace")
        steps_at_trace = logged_steps(run)
        for path in both:
            assert_chrome_trace(path)
        wait_for(lambda: logged_steps(run) >= steps_at_trace + 3, 60, proc, "training to continue")
        assert "seekforge_train_phase_seconds_count" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_serve_traces_on_request_and_keeps_serving(tmp_path):
    from seekforge.serve.async_engine import AsyncEngine
    from seekforge.serve.engine import LLMEngine
    from seekforge.serve.server import build_app

    engine = AsyncEngine(LLMEngine(build_model(preset("tiny"), seed=0).eval(), load_tokenizer("byte"),
                                   EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=128)))
    server = LiveServer(build_app(engine, "tiny", trace_dir=str(tmp_path / "traces")))
    try:
        client = httpx.Client(base_url=server.base_url, timeout=60)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        response = client.post("/debug/trace", params={"steps": 3})
        assert response.status_code == 202 and response.json()["steps"] == 3
        assert client.post("/debug/trace", params={"steps": 0}).status_code == 400
        assert client.post("/v1/completions", json=body).status_code == 200  # a prefill and 3 decode steps
        (path,) = wait_for(lambda: sorted((tmp_path / "traces").glob("*.json")), 30, what="the serve trace")
        first, last = map(int, path.stem.removeprefix("trace_rank0_steps").split("-"))
        assert last - first == 2  # three engine steps
        assert_chrome_trace(path)
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert "seekforge_serve_phase_seconds_count" in client.get("/metrics").text
    finally:
        server.stop()
        engine.shutdown()
