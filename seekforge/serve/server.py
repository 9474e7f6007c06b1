"""OpenAI-compatible HTTP server: `seekforge serve --model DIR_OR_PRESET` (default: the `tiny` preset).

Endpoints: /v1/completions, /v1/chat/completions (both with SSE streaming, a final usage chunk under
stream_options.include_usage, and the usage so far in every chunk under continuous_usage_stats, as in
vLLM), /v1/models, /health, /metrics (Prometheus), POST /debug/trace?steps=N (a profiler trace of the
next N engine steps, probe/trace.py).
Every bad request gets a 400 in OpenAI's error shape ({"error": {"message", "type", "param",
"code"}}); the engine keeps running. A client that disconnects has its request aborted and its KV
blocks freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from seekforge.probe.trace import OnDemandTracer, StepTimer
from seekforge.serve import limits
from seekforge.serve.engine import AsyncEngine, RequestOutput, chat_prompt_ids
from seekforge.serve.metrics import ServerMetrics
from seekforge.serve.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("seekforge.serve")


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.code, self.param = message, status, kind, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported parameter {where!r}; remove it")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              trace_dir: str = "traces") -> FastAPI:
    app = FastAPI(title="seekforge")
    core = engine.engine
    tokenizer = core.tokenizer
    metrics = ServerMetrics(core)
    app.state.metrics = metrics
    # Every engine step timed (seekforge_serve_phase_seconds) and traceable on request.
    app.state.tracer = tracer = OnDemandTracer(trace_dir)
    core.step = tracer.wrap(core.step, StepTimer(metrics.registry, "seekforge_serve"))

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return APIError(_validation_message(exc)).response()

    @app.exception_handler(ValueError)
    async def _value_error(_, exc: ValueError):
        return APIError(str(exc)).response()

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("unhandled error")
        return APIError(f"internal error: {exc}", 500, "internal_error").response()

    # A dependency, not an HTTP middleware: BaseHTTPMiddleware wraps `receive`, and then
    # Request.is_disconnected() never sees the client leave (found by test_non_streaming_disconnect_aborts).
    async def require_key(request: Request):
        if api_key:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError("invalid or missing API key; send 'Authorization: Bearer KEY'", 401,
                               "authentication_error", "invalid_api_key")

    v1 = [Depends(require_key)]

    def check(req) -> None:
        if req.model != model_name:
            raise APIError(f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found", param="model")
        problem = req.unsupported()
        if problem:
            raise APIError(problem)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/debug/trace", dependencies=v1, status_code=202)
    async def trace(steps: int = 3):
        return {"steps": tracer.request(steps), "dir": str(tracer.out_dir)}

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "seekforge", "max_model_len": core.max_model_len}]}

    @app.post("/v1/completions", dependencies=v1)
    async def completions(req: CompletionRequest, raw: Request):
        check(req)
        params = req.sampling_params(req.max_tokens, req.logprobs)
        streams = [engine.generate(p, params, cache_salt=req.cache_salt) for p in req.prompts()]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(i: int, c, text: str, logprob_entries, finish_reason):
            return {"index": i, "text": text, "finish_reason": finish_reason,
                    "logprobs": _completion_logprobs(tokenizer, logprob_entries) if logprob_entries is not None
                    else None}

        if req.stream:
            return _sse(_stream_chunks(streams, params.n, req, rid, created, "text_completion", choice,
                                       metrics, model_name))
        finals = await _collect(streams, raw, metrics)
        choices = [choice(k * params.n + c.index, c, c.text, c.logprobs, c.finish_reason)
                   for k, out in enumerate(finals) for c in out.outputs]
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(finals)}

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(req: ChatCompletionRequest, raw: Request):
        check(req)
        if not req.messages:
            raise APIError("messages is empty; give at least one message", param="messages")
        prompt_ids = chat_prompt_ids(tokenizer, [m.as_dict() for m in req.messages], req.add_generation_prompt)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(req.max_new_tokens, logprobs)
        streams = [engine.generate(prompt_ids, params, cache_salt=req.cache_salt)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(i: int, c, text: str, logprob_entries, finish_reason, delta=False):
            lp = {"content": _chat_logprobs(tokenizer, logprob_entries)} if logprob_entries is not None else None
            body = {"role": "assistant", "content": text} if not delta else {"content": text}
            return {"index": i, "delta" if delta else "message": body, "logprobs": lp,
                    "finish_reason": finish_reason}

        if req.stream:
            def delta_choice(i, c, text, entries, finish_reason):
                return choice(i, c, text, entries, finish_reason, delta=True)

            return _sse(_stream_chunks(streams, params.n, req, rid, created, "chat.completion.chunk",
                                       delta_choice, metrics, model_name, role_first=True))
        finals = await _collect(streams, raw, metrics)
        choices = [choice(c.index, c, c.text, c.logprobs, c.finish_reason) for c in finals[0].outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(finals)}

    return app


# ---------------------------------------------------------------------------------------- helpers
def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}


def _single_token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _completion_logprobs(tokenizer, entries: list[dict]) -> dict:
    tokens = [_single_token_text(tokenizer, e["token_id"]) for e in entries]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_single_token_text(tokenizer, i): lp for i, lp in e["top"]} for e in entries],
            "text_offset": offsets}


def _chat_logprobs(tokenizer, entries: list[dict]) -> list[dict]:
    def one(token_id, logprob):
        text = _single_token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(i, lp) for i, lp in e["top"]]}
            for e in entries]


async def _collect(streams: list[AsyncIterator[RequestOutput]], raw: Request, metrics) -> list[RequestOutput]:
    """Run the streams to the end; if the client goes away meanwhile, cancel them (which aborts)."""

    async def last(stream):
        final = None
        async for out in stream:
            final = out
        return final

    tasks = [asyncio.create_task(last(s)) for s in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.5)
            if not pending:
                break
            if await raw.is_disconnected():
                raise APIError("client disconnected", 499)
        finals = [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
    for out in finals:
        metrics.observe(out)
    return finals


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output); cancelling stops all of them."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(k, stream):
        try:
            async for out in stream:
                await merged.put((k, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await merged.put((k, e))
        await merged.put((k, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream_chunks(streams, n: int, req, rid: str, created: int, obj: str, choice, metrics,
                         model_name: str, role_first: bool = False) -> AsyncIterator[str]:
    """SSE chunks: text deltas per choice; then, if asked, one usage chunk with no choices. With
    stream_options.continuous_usage_stats every chunk also carries the request's usage so far."""
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    num_prompt_tokens: dict[int, int] = {}  # per stream, from its first output
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished_choices: set[int] = set()
    finals: dict[int, RequestOutput] = {}

    def chunk(choices, usage=None):
        body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}
        if usage is None and continuous:
            prompt, completion = sum(num_prompt_tokens.values()), sum(sent_tokens.values())
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        async for k, out in _merge(streams):
            if k not in num_prompt_tokens:
                num_prompt_tokens[k] = len(out.prompt_token_ids)
                if role_first:
                    for c in out.outputs:
                        yield chunk([{"index": k * n + c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
            for c in out.outputs:
                i = k * n + c.index
                if i in finished_choices:
                    continue
                text = c.text[sent_text.get(i, 0):]
                entries = c.logprobs[sent_tokens.get(i, 0):] if c.logprobs is not None else None
                # one chunk per step that produced tokens, even when their text is still held back
                # (partial UTF-8, possible stop string): clients and `bench serve` time tokens by chunk
                if len(c.token_ids) > sent_tokens.get(i, 0) or c.finish_reason:
                    sent_text[i] = len(c.text)
                    sent_tokens[i] = len(c.token_ids)
                    yield chunk([choice(i, c, text, entries, c.finish_reason)])
                if c.finish_reason:
                    finished_choices.add(i)
            if out.finished:
                finals[k] = out
                metrics.observe(out)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage([finals[k] for k in sorted(finals)]))
    except Exception as e:  # the stream has started: report in-band, as OpenAI does
        log.exception("stream failed")
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'internal_error'}})}\n\n"
    yield "data: [DONE]\n\n"


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------------- CLI
def add_arguments(p):
    p.add_argument("--model", default="tiny", help="preset name or HF-format checkpoint directory")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` name clients send; when unset, the --model value")
    p.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes the server")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 where the hardware runs it natively (GPU, AVX512-BF16/AMX), else float32")
    p.add_argument("--kv-cache-memory", default="512MiB", help="memory for the paged latent KV cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--trace-dir", default="traces", help="where POST /debug/trace and SIGUSR2 write profiler traces")
    limits.add_arguments(p)


def engine_config_from_args(args):
    from seekforge.config import EngineConfig

    return EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_chunked_prefill=not args.no_chunked_prefill,
                        enable_prefix_caching=not args.no_prefix_caching)


def run(args):
    import torch

    from seekforge.model.load import load_model
    from seekforge.model.precision import resolve_dtype
    from seekforge.serve.engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, why = resolve_dtype(args.dtype)
    logging.getLogger("seekforge.serve").info("dtype: %s", why)
    model, tokenizer = load_model(args.model, dtype)
    engine = AsyncEngine(LLMEngine(model, tokenizer, engine_config_from_args(args)))
    app = build_app(engine, args.served_model_name or args.model, args.api_key, args.trace_dir)
    app.state.tracer.install_signal()
    try:
        limits.serve(app, limits.limits_from_args(args), args.host, args.port, args.log_level)
    finally:
        engine.shutdown()
