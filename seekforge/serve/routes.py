"""The server's endpoints, one handler each on `router`; server.build_app mounts them. A handler reaches
the engine, the served model's name and the API key through `ServerState` (app.state.serve), which
FastAPI hands it as the `Served` dependency."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from seekforge.probe.trace import OnDemandTracer
from seekforge.serve.api_errors import APIError
from seekforge.serve.async_engine import AsyncEngine
from seekforge.serve.engine import LLMEngine, chat_prompt_ids
from seekforge.serve.metrics import ServerMetrics
from seekforge.serve.openai_format import ChatChoices, CompletionChoices, piece, usage, vllm_prompt_logprobs
from seekforge.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    tool_dicts,
)
from seekforge.serve.streaming import collect, sse, stream_chunks
from seekforge.serve.structured import StructuredOutput
from seekforge.serve.tools import check_tools, messages_for_template, tool_call_grammar


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str  # what clients send as `model` for the base model
    api_key: str | None
    metrics: ServerMetrics
    tracer: OnDemandTracer

    @property
    def core(self) -> LLMEngine:
        return self.engine.engine

    def check_model(self, name: str | None) -> str | None:
        """→ the LoRA adapter `name` selects (None: the base model); an unknown model is OpenAI's 404."""
        if name is None or name == self.model_name:
            return None
        if name not in self.core.lora_adapters:
            raise APIError(f"The model {name!r} does not exist; this server serves {self.model_name!r}"
                           + "".join(f", {a!r}" for a in self.core.lora_adapters), 404, code="model_not_found",
                           param="model")
        return name

    def check(self, req) -> str | None:
        """Validate a generation request; → the LoRA adapter its `model` names (None: the base model)."""
        lora = self.check_model(req.model)
        req.check_supported()  # InvalidSetting: a 400 naming the field
        return lora


def served(request: Request) -> ServerState:
    return request.app.state.serve


Served = Annotated[ServerState, Depends(served)]


# A dependency, not an HTTP middleware: BaseHTTPMiddleware wraps `receive`, and then
# Request.is_disconnected() never sees the client leave (found by test_non_streaming_disconnect_aborts).
async def require_key(request: Request):
    api_key = served(request).api_key
    if api_key:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110), the key is not
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError("invalid or missing API key; send 'Authorization: Bearer KEY'", 401,
                           "authentication_error", "invalid_api_key")


router = APIRouter()
v1 = [Depends(require_key)]


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(s: Served):
    return Response(s.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/debug/trace", dependencies=v1, status_code=202)
async def trace(s: Served, steps: int = 3):
    return {"steps": s.tracer.request(steps), "dir": str(s.tracer.out_dir)}


@router.get("/v1/models", dependencies=v1)
async def models(s: Served):
    now = int(time.time())
    base = {"id": s.model_name, "object": "model", "created": now, "owned_by": "seekforge",
            "root": s.model_name, "parent": None, "max_model_len": s.core.max_model_len}
    adapters = [{**base, "id": name, "root": adapter.path, "parent": s.model_name}
                for name, adapter in s.core.lora_adapters.items()]
    return {"object": "list", "data": [base, *adapters]}


# LoRA adapters at run time, as vLLM names the endpoints (body {lora_name, lora_path} / {lora_name})
@router.post("/v1/load_lora_adapter", dependencies=v1)
async def load_lora_adapter(body: LoadLoRARequest, s: Served):
    if body.lora_name == s.model_name:
        raise APIError(f"lora_name {body.lora_name!r} is the base model's name; pick another")
    await asyncio.to_thread(s.core.load_lora, body.lora_name, body.lora_path)  # reads files: off the loop
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")


@router.post("/v1/unload_lora_adapter", dependencies=v1)
async def unload_lora_adapter(body: UnloadLoRARequest, s: Served):
    try:
        s.core.unload_lora(body.lora_name)
    except KeyError:
        raise APIError(f"the LoRA adapter {body.lora_name!r} cannot be found", 404, "not_found_error",
                       param="lora_name") from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


@router.post("/tokenize", dependencies=v1)
async def tokenize(req: TokenizeRequest, s: Served):
    s.check_model(req.model)
    tokenizer = s.core.tokenizer
    if req.messages is not None:
        messages = messages_for_template([m.as_dict() for m in req.messages],
                                         check_tools(tool_dicts(req.tools), None))
        text = tokenizer.apply_chat_template(messages, req.add_generation_prompt)
    else:
        text = req.prompt
    # add_special_tokens: a BOS where the tokenizer puts one on prompts, as transformers does
    add_bos = bool(req.add_special_tokens) and getattr(tokenizer, "add_bos_token", False)
    ids = tokenizer.encode(text, add_bos=add_bos)
    return {"count": len(ids), "max_model_len": s.core.max_model_len, "tokens": ids,
            "token_strs": [piece(tokenizer, i) for i in ids] if req.return_token_strs else None}


@router.post("/detokenize", dependencies=v1)
async def detokenize(req: DetokenizeRequest, s: Served):
    s.check_model(req.model)
    vocab_size = s.core.model.cfg.vocab_size
    if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab_size):
        raise APIError(f"tokens must be ids in [0, {vocab_size})", param="tokens")
    return {"prompt": s.core.tokenizer.decode(req.tokens)}


@router.post("/v1/completions", dependencies=v1)
async def completions(req: CompletionRequest, raw: Request, s: Served):
    lora = s.check(req)
    params = req.completion_params()
    streams = [s.engine.generate(p, params, cache_salt=req.cache_salt, lora_name=lora, final_only=not req.stream)
               for p in req.prompts()]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choice = CompletionChoices(s.core.tokenizer, req)
    if req.stream:
        return sse(stream_chunks(streams, params.n, req, rid, created, "text_completion", choice, s.metrics,
                                 lora or s.model_name))
    finals = await collect(streams, raw, s.metrics)
    choices = [choice(k * params.n + c.index, out, c.text, c.logprobs, c.finish_reason)
               for k, out in enumerate(finals) for c in out.outputs]
    return {"id": rid, "object": "text_completion", "created": created, "model": lora or s.model_name,
            "choices": choices, "usage": usage(finals, scored_only=choice.echo_only)}


@router.post("/v1/chat/completions", dependencies=v1)
async def chat(req: ChatCompletionRequest, raw: Request, s: Served):
    lora = s.check(req)
    if not req.messages:
        raise APIError("messages is empty; give at least one message", param="messages")
    tokenizer = s.core.tokenizer
    tools = tool_dicts(req.tools)
    callable_tools = check_tools(tools, req.tool_choice)
    use_tools = bool(callable_tools) and req.tool_choice != "none"
    messages = messages_for_template([m.as_dict() for m in req.messages], tools if use_tools else None)
    prompt_ids = chat_prompt_ids(tokenizer, messages, req.add_generation_prompt)
    params = req.sampling_params(req.max_new_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    if use_tools:  # the call markers are special tokens in DeepSeek's tokenizer: keep them to parse
        params.skip_special_tokens = False
    if use_tools and req.tool_choice not in (None, "auto"):  # required / named: the format is enforced
        if params.structured is not None:
            raise APIError("tool_choice required or named cannot be combined with response_format / guided_*")
        # a named function is called once; "required" calls several if parallel_tool_calls (OpenAI)
        parallel = req.tool_choice == "required" and req.parallel_tool_calls
        params.structured = StructuredOutput(grammar=tool_call_grammar(callable_tools, parallel))
    streams = [s.engine.generate(prompt_ids, params, cache_salt=req.cache_salt, lora_name=lora,
                                 final_only=not req.stream)]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    choice = ChatChoices(tokenizer, use_tools, delta=req.stream)
    if req.stream:
        return sse(stream_chunks(streams, params.n, req, rid, created, "chat.completion.chunk", choice, s.metrics,
                                 lora or s.model_name, role_first=True))
    finals = await collect(streams, raw, s.metrics)
    choices = [choice(c.index, finals[0], c.text, c.logprobs, c.finish_reason) for c in finals[0].outputs]
    extras = {"prompt_logprobs": vllm_prompt_logprobs(tokenizer, finals[0])} if req.prompt_logprobs is not None \
        else {}
    return {"id": rid, "object": "chat.completion", "created": created, "model": lora or s.model_name,
            "choices": choices, "usage": usage(finals), **extras}
