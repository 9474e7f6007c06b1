"""OpenAI-compatible HTTP server: `build_app(engine, model_name)` is the FastAPI app that
`seekforge serve` (cli.py) runs behind limits.py's admission and drain.

Endpoints (routes.py): /v1/completions, /v1/chat/completions (both with SSE streaming, a final usage
chunk under stream_options.include_usage, and the usage so far in every chunk under
continuous_usage_stats, as in vLLM), /v1/models, /tokenize and /detokenize (vLLM's), /health,
/metrics (Prometheus), POST /debug/trace?steps=N (a profiler trace of the next N engine steps,
probe/trace.py), /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's).
Completions take `echo` and prompt logprobs (`logprobs` + `max_tokens: 0` scores a prompt, as
lm-eval's local-completions sends; vLLM's `prompt_logprobs`); both endpoints take structured output
(response_format, guided_*, structured_outputs: structured.py); chat takes tools in DeepSeek-V3's
format (tools.py). Responses are shaped by openai_format.py and streamed by streaming.py.
Every bad request gets a 400 in OpenAI's error shape (api_errors.py), an unknown model a 404
`model_not_found`; the engine keeps running. A client that disconnects has its request aborted and
its KV blocks freed.
"""

from __future__ import annotations

from fastapi import FastAPI

from seekforge.probe.trace import OnDemandTracer, StepTimer
from seekforge.serve.api_errors import install_error_handlers
from seekforge.serve.async_engine import AsyncEngine
from seekforge.serve.metrics import ServerMetrics
from seekforge.serve.routes import ServerState, router


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              trace_dir: str = "traces") -> FastAPI:
    app = FastAPI(title="seekforge")
    core = engine.engine
    metrics = ServerMetrics(core)
    # Every engine step timed (seekforge_serve_phase_seconds) and traceable on request.
    tracer = OnDemandTracer(trace_dir)
    core.step = tracer.wrap(core.step, StepTimer(metrics.registry, "seekforge_serve"))
    app.state.serve = ServerState(engine, model_name, api_key, metrics, tracer)
    install_error_handlers(app)
    app.include_router(router)
    return app
