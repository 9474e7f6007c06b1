"""OpenAI-compatible HTTP server: `seekforge serve --model DIR_OR_PRESET` (default: the `tiny` preset).

Endpoints: /v1/completions, /v1/chat/completions (both with SSE streaming, a final usage chunk under
stream_options.include_usage, and the usage so far in every chunk under continuous_usage_stats, as in
vLLM), /v1/models, /tokenize and /detokenize (vLLM's), /health, /metrics (Prometheus),
POST /debug/trace?steps=N (a profiler trace of the next N engine steps, probe/trace.py).
Completions take `echo` and prompt logprobs (`logprobs` + `max_tokens: 0` scores a prompt, as
lm-eval's local-completions sends; vLLM's `prompt_logprobs`); both endpoints take structured output
(response_format, guided_*, structured_outputs: structured.py); chat takes tools in DeepSeek-V3's
format (tools.py).
Every bad request gets a 400 in OpenAI's error shape ({"error": {"message", "type", "param",
"code"}}), an unknown model a 404 `model_not_found`; the engine keeps running. A client that
disconnects has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import codecs
import gc
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from seekforge.config import PRESETS
from seekforge.errors import InvalidSetting
from seekforge.model.precision import auto_dtype_help
from seekforge.probe.trace import OnDemandTracer, StepTimer
from seekforge.serve import limits
from seekforge.serve.engine import AsyncEngine, RequestOutput, chat_prompt_ids
from seekforge.serve.metrics import ServerMetrics
from seekforge.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    tool_dicts,
)
from seekforge.serve.structured import StructuredOutput
from seekforge.serve.tools import (
    ToolCallStream,
    check_tools,
    messages_for_template,
    parse_tool_calls,
    tool_call_grammar,
)

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
        if not where:  # the body as a whole: missing, or no JSON object (or sent without the JSON content type)
            return "the request body must be a JSON object, sent with 'Content-Type: application/json'"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported parameter {where!r}; remove it")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def _validation_param(exc: RequestValidationError) -> str | None:
    """The first offending field, as OpenAI's `param` names it (None for a body that is not JSON)."""
    errors = exc.errors()
    if not errors or errors[0].get("type") == "json_invalid":  # its loc is a position in the text, not a field
        return None
    return ".".join(str(x) for x in errors[0].get("loc", ()) if x != "body") or None


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
        return APIError(_validation_message(exc), param=_validation_param(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # an unknown route or method: OpenAI's error shape ("Invalid URL (POST /v1/x)"), not FastAPI's
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return APIError(message, exc.status_code).response()

    @app.exception_handler(ValueError)
    async def _value_error(_, exc: ValueError):
        return APIError(str(exc), param=exc.name if isinstance(exc, InvalidSetting) else None).response()

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("unhandled error")
        return APIError(f"internal error: {exc}", 500, "internal_error").response()

    # A dependency, not an HTTP middleware: BaseHTTPMiddleware wraps `receive`, and then
    # Request.is_disconnected() never sees the client leave (found by test_non_streaming_disconnect_aborts).
    async def require_key(request: Request):
        if api_key:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            # the scheme is case-insensitive (RFC 9110), the key is not
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), api_key.encode()):
                raise APIError("invalid or missing API key; send 'Authorization: Bearer KEY'", 401,
                               "authentication_error", "invalid_api_key")

    v1 = [Depends(require_key)]

    def check_model(name: str | None) -> str | None:
        """→ the LoRA adapter `name` selects (None: the base model); an unknown model is OpenAI's 404."""
        if name is None or name == model_name:
            return None
        if name not in core.lora_adapters:
            raise APIError(f"The model {name!r} does not exist; this server serves {model_name!r}"
                           + "".join(f", {a!r}" for a in core.lora_adapters), 404, code="model_not_found",
                           param="model")
        return name

    def check(req) -> str | None:
        """Validate; → the LoRA adapter the request's `model` names (None: the base model)."""
        lora = check_model(req.model)
        req.check_supported()  # InvalidSetting: a 400 naming the field
        return lora

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
        now = int(time.time())
        base = {"id": model_name, "object": "model", "created": now, "owned_by": "seekforge",
                "root": model_name, "parent": None, "max_model_len": core.max_model_len}
        adapters = [{**base, "id": name, "root": adapter.path, "parent": model_name}
                    for name, adapter in core.lora_adapters.items()]
        return {"object": "list", "data": [base, *adapters]}

    # LoRA adapters at run time, as vLLM names the endpoints (body {lora_name, lora_path} / {lora_name})
    @app.post("/v1/load_lora_adapter", dependencies=v1)
    async def load_lora_adapter(body: LoadLoRARequest):
        if body.lora_name == model_name:
            raise APIError(f"lora_name {body.lora_name!r} is the base model's name; pick another")
        await asyncio.to_thread(core.load_lora, body.lora_name, body.lora_path)  # reads files: off the loop
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=v1)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        try:
            core.unload_lora(body.lora_name)
        except KeyError:
            raise APIError(f"the LoRA adapter {body.lora_name!r} cannot be found", 404, "not_found_error",
                           param="lora_name") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/tokenize", dependencies=v1)
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if req.messages is not None:
            messages = messages_for_template([m.as_dict() for m in req.messages],
                                             check_tools(tool_dicts(req.tools), None))
            text = tokenizer.apply_chat_template(messages, req.add_generation_prompt)
        else:
            text = req.prompt
        # add_special_tokens: a BOS where the tokenizer puts one on prompts, as transformers does
        add_bos = bool(req.add_special_tokens) and getattr(tokenizer, "add_bos_token", False)
        ids = tokenizer.encode(text, add_bos=add_bos)
        return {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids,
                "token_strs": [_piece(tokenizer, i) for i in ids] if req.return_token_strs else None}

    @app.post("/detokenize", dependencies=v1)
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= core.model.cfg.vocab_size):
            raise APIError(f"tokens must be ids in [0, {core.model.cfg.vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/v1/completions", dependencies=v1)
    async def completions(req: CompletionRequest, raw: Request):
        lora = check(req)
        params = req.completion_params()
        streams = [engine.generate(p, params, cache_salt=req.cache_salt, lora_name=lora, final_only=not req.stream)
                   for p in req.prompts()]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo_only = req.max_tokens == 0  # score the prompt: show it, not the one token the engine ran
        started: set[int] = set()  # choices whose first chunk went out (streaming: it alone has the prompt)

        def choice(i: int, out: RequestOutput, text: str, logprob_entries, finish_reason):
            first = i not in started
            started.add(i)
            if echo_only:
                text, logprob_entries = "", [] if logprob_entries is not None else None
                finish_reason = finish_reason and "length"
            if req.echo and first:
                text = tokenizer.decode(out.prompt_token_ids) + text
                if logprob_entries is not None:
                    logprob_entries = _prompt_entries(out) + logprob_entries
            body = {"index": i, "text": text, "finish_reason": finish_reason,
                    "logprobs": _completion_logprobs(tokenizer, logprob_entries) if logprob_entries is not None
                    else None}
            if req.prompt_logprobs is not None and first:
                body["prompt_logprobs"] = _vllm_prompt_logprobs(tokenizer, out)
            return body

        if req.stream:
            return _sse(_stream_chunks(streams, params.n, req, rid, created, "text_completion", choice,
                                       metrics, lora or model_name))
        finals = await _collect(streams, raw, metrics)
        choices = [choice(k * params.n + c.index, out, c.text, c.logprobs, c.finish_reason)
                   for k, out in enumerate(finals) for c in out.outputs]
        return {"id": rid, "object": "text_completion", "created": created, "model": lora or model_name,
                "choices": choices, "usage": _usage(finals, scored_only=echo_only)}

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(req: ChatCompletionRequest, raw: Request):
        lora = check(req)
        if not req.messages:
            raise APIError("messages is empty; give at least one message", param="messages")
        tools = tool_dicts(req.tools)
        callable_tools = check_tools(tools, req.tool_choice)
        use_tools = bool(callable_tools) and req.tool_choice != "none"
        messages = messages_for_template([m.as_dict() for m in req.messages], tools if use_tools else None)
        prompt_ids = chat_prompt_ids(tokenizer, messages, req.add_generation_prompt)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(req.max_new_tokens, logprobs)
        if use_tools:  # the call markers are special tokens in DeepSeek's tokenizer: keep them to parse
            params.skip_special_tokens = False
        if use_tools and req.tool_choice not in (None, "auto"):  # required / named: the format is enforced
            if params.structured is not None:
                raise APIError("tool_choice required or named cannot be combined with response_format / guided_*")
            # a named function is called once; "required" calls several if parallel_tool_calls (OpenAI)
            parallel = req.tool_choice == "required" and req.parallel_tool_calls
            params.structured = StructuredOutput(grammar=tool_call_grammar(callable_tools, parallel))
        streams = [engine.generate(prompt_ids, params, cache_salt=req.cache_salt, lora_name=lora,
                                   final_only=not req.stream)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tool_streams: dict[int, ToolCallStream] = {}

        def choice(i: int, out: RequestOutput, text: str, logprob_entries, finish_reason, delta=False):
            lp = {"content": _chat_logprobs(tokenizer, logprob_entries)} if logprob_entries is not None else None
            body: dict = {} if delta else {"role": "assistant"}
            if use_tools and delta:
                content, calls = tool_streams.setdefault(i, ToolCallStream()).update(
                    out.outputs[i].text, finish_reason is not None)
                body["content"] = content
                if calls:
                    body["tool_calls"] = calls
                if finish_reason == "stop" and tool_streams[i].num_calls:
                    finish_reason = "tool_calls"
            elif use_tools:
                content, calls = parse_tool_calls(text)
                body["content"] = content
                if calls:
                    body["tool_calls"] = calls
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            else:
                body["content"] = text
            return {"index": i, "delta" if delta else "message": body, "logprobs": lp,
                    "finish_reason": finish_reason}

        def response_extras(out: RequestOutput) -> dict:
            return {"prompt_logprobs": _vllm_prompt_logprobs(tokenizer, out)} if req.prompt_logprobs is not None else {}

        if req.stream:
            def delta_choice(i, out, text, entries, finish_reason):
                return choice(i, out, text, entries, finish_reason, delta=True)

            return _sse(_stream_chunks(streams, params.n, req, rid, created, "chat.completion.chunk",
                                       delta_choice, metrics, lora or model_name, role_first=True))
        finals = await _collect(streams, raw, metrics)
        choices = [choice(c.index, finals[0], c.text, c.logprobs, c.finish_reason) for c in finals[0].outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": lora or model_name,
                "choices": choices, "usage": _usage(finals), **response_extras(finals[0])}

    return app


# ---------------------------------------------------------------------------------------- helpers
def _usage(finals: list[RequestOutput], scored_only: bool = False) -> dict:
    """OpenAI's usage; scored_only: max_tokens=0 with echo, whose one token the engine ran is not shown, nor counted."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = 0 if scored_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}


def _token_bytes(tokenizer, token_id: int) -> bytes:
    token_bytes = getattr(tokenizer, "token_bytes", None)  # seekforge's tokenizers; another: its decoded text
    return token_bytes(token_id) if token_bytes else tokenizer.decode([token_id]).encode()


def _piece(tokenizer, token_id: int) -> str | None:
    """The token's vocabulary string, as vLLM's /tokenize returns it (convert_ids_to_tokens)."""
    piece = getattr(tokenizer, "piece", None)
    return piece(token_id) if piece else tokenizer.decode([token_id])


def _single_token_text(tokenizer, token_id: int) -> str:
    """One token as logprobs show it: its text, or where its bytes are part of a character, "bytes:\\xNN…" (as
    OpenAI writes such tokens), so that distinct tokens never read the same."""
    data = _token_bytes(tokenizer, token_id)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _prompt_entries(out: RequestOutput) -> list[dict]:
    """The prompt's logprob entries for echo: the first token has no logprob (null), as in OpenAI."""
    first = {"token_id": out.prompt_token_ids[0], "logprob": None, "top": None}
    return [first, *out.prompt_logprobs[1:]]


def _completion_logprobs(tokenizer, entries: list[dict]) -> dict:
    tokens = [_single_token_text(tokenizer, e["token_id"]) for e in entries]
    # each token's first character in the decoded text: bytes decoded as they come, a character split over tokens
    # counted where it ends
    decoder, offsets, pos = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(decoder.decode(_token_bytes(tokenizer, e["token_id"])))
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {_single_token_text(tokenizer, i): lp for i, lp in e["top"]}
                             for e in entries],
            "text_offset": offsets}


def _vllm_prompt_logprobs(tokenizer, out: RequestOutput) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {"logprob", "rank",
    "decoded_token"}} holding the prompt token and the top k."""
    result: list[dict | None] = [None]
    for e in out.prompt_logprobs[1:]:
        entry = {str(e["token_id"]): {"logprob": e["logprob"], "rank": e["rank"],
                                      "decoded_token": _single_token_text(tokenizer, e["token_id"])}}
        for rank, (i, lp) in enumerate(e["top"], 1):
            entry.setdefault(str(i), {"logprob": lp, "rank": rank, "decoded_token": _single_token_text(tokenizer, i)})
        result.append(entry)
    return result


def _chat_logprobs(tokenizer, entries: list[dict]) -> list[dict]:
    def one(token_id, logprob):
        return {"token": _single_token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": list(_token_bytes(tokenizer, token_id))}

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
                    yield chunk([choice(i, out, text, entries, c.finish_reason)])
                if c.finish_reason:
                    finished_choices.add(i)
            if out.finished:
                finals[k] = out
                metrics.observe(out)
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage([finals[k] for k in sorted(finals)], scored_only=req.max_tokens == 0))
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
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32", "bfloat16", "float32"], default="auto",
                   help=f"auto: {auto_dtype_help()}")
    p.add_argument("--kv-cache-memory", default="512MiB", help="memory for the paged latent KV cache")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="int8: cache c_kv and k_pe per token in int8 with an fp32 scale (about 1/2 of bf16's bytes)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoding at once, at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens one step computes, at most (a long prompt prefills in chunks of this size)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request, at most (None: the model's max_position_embeddings)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute shared prompt prefixes instead of reusing their cached blocks")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="k > 0: the model's MTP modules draft k tokens per step, one pass verifies them")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="N > 1: N decode steps per scheduler pass while no prefill waits")
    p.add_argument("--compile", action="store_true",
                   help="run decode steps as torch.compile'd programs (needs a C++ compiler; ~2 min at start on 2 "
                        "cores the first time, ~15 s from the compile cache after): on CPU ~1.7x faster decoding of "
                        "one sequence, ~1.1x at 64; falls back to eager, with a warning, where compiling fails")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (POST /v1/load_lora_adapter at run time); implied by --lora-modules")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapter directories to load at start; a request's `model` selects one by NAME")
    p.add_argument("--tp", type=int, default=1,
                   help="under torchrun: attention (and dense MLP) tensor parallel over this many ranks per replica")
    p.add_argument("--dp-attention", type=int, default=1,
                   help="under torchrun: attention data parallel: this many replicas, each with its own requests, "
                        "scheduler and latent cache (world size = tp x dp-attention)")
    p.add_argument("--ep", type=int, default=1,
                   help="under torchrun: split the routed experts over groups of this many ranks (all-to-all dispatch)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (None: torch's choice)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="server log verbosity")
    p.add_argument("--trace-dir", default="traces", help="where POST /debug/trace and SIGUSR2 write profiler traces")
    limits.add_arguments(p)


def engine_config_from_args(args):
    from seekforge.config import EngineConfig

    return EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_chunked_prefill=not args.no_chunked_prefill,
                        enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                        speculative_tokens=args.speculative_tokens, num_scheduler_steps=args.num_scheduler_steps,
                        enable_lora=args.enable_lora or bool(args.lora_modules), compile=args.compile)


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """["name=path", ...] → [(name, path)]."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: write NAME=PATH (a PEFT adapter directory)")
        pairs.append((name, path))
    return pairs


def run(args):
    import torch

    from seekforge.model.load import model_width
    from seekforge.model.precision import resolve_dtype
    from seekforge.quant.load import load_model  # quantized checkpoints too
    from seekforge.serve.engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # flags that need no model are checked before the model loads
    limits.limits_from_args(args)
    parse_lora_modules(args.lora_modules)
    if args.model not in PRESETS and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint "
                         "directory")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, why = resolve_dtype(args.dtype, hidden_size=model_width(args.model))
    logging.getLogger("seekforge.serve").info("dtype: %s", why)
    if args.tp * args.dp_attention * args.ep > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return run_distributed(args, dtype)
    model, tokenizer = load_model(args.model, dtype)
    core = LLMEngine(model, tokenizer, engine_config_from_args(args))
    for name, path in parse_lora_modules(args.lora_modules):
        core.load_lora(name, path)
    serve_engine(core, args)


def serve_engine(core, args) -> None:
    engine = AsyncEngine(core)
    app = build_app(engine, args.served_model_name or args.model, args.api_key, args.trace_dir)
    app.state.tracer.install_signal()
    # By now ~620k objects are alive (the compiled programs, the pools' block records), and a full collection of
    # them took 0.5-1.0 s on 2 cores: a pause in every stream it lands on. Frozen, the collector passes over them,
    # as vLLM does after its startup; what serving allocates later is collected as usual.
    gc.collect()
    gc.freeze()
    try:
        limits.serve(app, limits.limits_from_args(args), args.host, args.port, args.log_level)
    finally:
        engine.shutdown()


def run_distributed(args, dtype) -> None:
    """Under torchrun (serve/distributed.py): rank 0 serves HTTP; the other ranks step with it."""
    import torch.distributed as dist

    from seekforge.serve.distributed import start

    core = start(args.model, args.tp, args.dp_attention, args.ep, dtype, engine_config_from_args(args))
    try:
        if core is not None:  # rank 0; the others return once rank 0 stops them
            try:
                serve_engine(core, args)
            finally:
                core.shutdown()
    finally:
        dist.destroy_process_group()
