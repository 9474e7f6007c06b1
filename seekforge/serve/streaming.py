"""From the engine's output streams to a response: run them to the end (aborting when the client
leaves), or turn them into Server-Sent Events as OpenAI streams them: one chunk per step that made
tokens, a usage chunk under stream_options.include_usage, the usage so far in every chunk under
continuous_usage_stats (as vLLM does), errors in-band once a stream has started, then [DONE]."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from seekforge.serve.api_errors import APIError
from seekforge.serve.engine import RequestOutput
from seekforge.serve.openai_format import usage

log = logging.getLogger("seekforge.serve")


async def collect(streams: list[AsyncIterator[RequestOutput]], raw: Request, metrics) -> list[RequestOutput]:
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


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def stream_chunks(streams, n: int, req, rid: str, created: int, obj: str, choice, metrics,
                        model_name: str, role_first: bool = False) -> AsyncIterator[str]:
    """SSE chunks: text deltas per choice (built by `choice`, openai_format's CompletionChoices or
    ChatChoices); then, if asked, one usage chunk with no choices. With stream_options.continuous_usage_stats
    every chunk also carries the request's usage so far."""
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    num_prompt_tokens: dict[int, int] = {}  # per stream, from its first output
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished_choices: set[int] = set()
    finals: dict[int, RequestOutput] = {}

    def chunk(choices, usage_now=None):
        body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}
        if usage_now is None and continuous:
            prompt, completion = sum(num_prompt_tokens.values()), sum(sent_tokens.values())
            usage_now = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if usage_now is not None:
            body["usage"] = usage_now
        return f"data: {json.dumps(body)}\n\n"

    try:
        async for k, out in merge(streams):
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
            yield chunk([], usage([finals[k] for k in sorted(finals)], scored_only=req.max_tokens == 0))
    except Exception as e:  # the stream has started: report in-band, as OpenAI does
        log.exception("stream failed")
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'internal_error'}})}\n\n"
    yield "data: [DONE]\n\n"


def sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
