"""The server under pressure: request limits, bounded admission and a graceful drain, as one ASGI
middleware in front of the OpenAI app (server.py), so that no endpoint has to remember them.

- Limits: a body larger than max_body_bytes, `n` above max_n, or more prompts × n than max_n get a
  400 in OpenAI's error shape naming the limit. (Prompt length and max_tokens against the model's
  context are the engine's own 400s: it knows the tokenizer and max_model_len.)
- Admission: at most max_concurrent generation requests run; up to max_queue more wait, each at most
  queue_timeout_s; past either bound a 503 with Retry-After. Memory is bounded by construction: a
  waiting request holds only its (size-limited) body.
- Drain (SIGTERM): uvicorn closes the listening socket (new connections are refused); new requests on
  connections already open get 503, and so does /health, so balancers stop routing; in-flight
  requests run on until shutdown_grace_s, then a stream gets a final error event and [DONE], a
  non-streaming request a 503, and its generation is cancelled (which aborts it and frees its KV
  blocks, as a client disconnect does). uvicorn then exits 0.

A pure ASGI middleware, not BaseHTTPMiddleware: that one wraps `receive` so that the app never sees
a client disconnect (routes.py's comment on require_key).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import signal
import time
from dataclasses import dataclass


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_concurrent: int = 256
    max_queue: int = 1024
    queue_timeout_s: float = 30.0
    shutdown_grace_s: float = 30.0


class Rejected(Exception):
    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


def _error_body(message: str, kind: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


async def _send_json(send, status: int, body: bytes, retry_after: float | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(retry_after))).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class LimitsMiddleware:
    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits
        self.running = 0
        self.waiting = 0
        self._slots: asyncio.Semaphore | None = None  # made in the server's event loop
        self.drain_deadline: float | None = None
        self._drain: asyncio.Event | None = None

    # ------------------------------------------------------------------ drain
    def begin_drain(self) -> None:
        """Called from the SIGTERM handler (in the event loop's thread)."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.limits.shutdown_grace_s
            if self._drain is not None:
                self._drain.set()

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    # ------------------------------------------------------------------ admission
    async def _admit(self) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.max_concurrent)
            self._drain = asyncio.Event()
            if self.draining:
                self._drain.set()
        if self.draining:
            raise Rejected(503, "the server is shutting down; retry on another replica", "shutting_down",
                           self.limits.shutdown_grace_s)
        if self._slots.locked() and self.waiting >= self.limits.max_queue:
            raise Rejected(503, f"the server is overloaded: {self.running} requests running and {self.waiting} "
                                f"waiting (max_queue={self.limits.max_queue}); retry later", "overloaded",
                           self.limits.queue_timeout_s)
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.limits.queue_timeout_s)
        except TimeoutError:
            raise Rejected(503, f"the server is overloaded: no slot freed within queue_timeout_s="
                                f"{self.limits.queue_timeout_s:g}; retry later", "overloaded",
                           self.limits.queue_timeout_s) from None
        finally:
            self.waiting -= 1
        self.running += 1

    def _release(self) -> None:
        self.running -= 1
        self._slots.release()

    # ------------------------------------------------------------------ limits
    def _check(self, body: bytes) -> None:
        try:
            req = json.loads(body)
        except ValueError:
            return  # the app answers malformed JSON with its own 400
        except RecursionError:  # which the app's own parser would meet too, as a 500
            raise Rejected(400, "the request body nests JSON arrays or objects too deeply to parse; no OpenAI "
                                "field needs more than a few levels", "invalid_json") from None
        if not isinstance(req, dict):
            return
        n = req.get("n", 1)
        if isinstance(n, int) and n > self.limits.max_n:
            raise Rejected(400, f"n={n} exceeds this server's limit of {self.limits.max_n}; ask for at most "
                                f"{self.limits.max_n} choices per request", "n_too_large")
        prompt = req.get("prompt")
        batch = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        if isinstance(n, int) and batch * n > self.limits.max_n:
            raise Rejected(400, f"{batch} prompts × n={n} = {batch * n} sequences exceed this server's limit of "
                                f"{self.limits.max_n} per request; split the batch", "batch_too_large")

    async def _read_body(self, receive, headers: dict) -> bytes | None:
        """The whole body, at most max_body_bytes (None: the client left)."""
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Rejected(400, f"the request body has {int(declared)} bytes; this server accepts at most {limit}",
                           "body_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise Rejected(400, f"the request body exceeds {limit} bytes, this server's limit",
                               "body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == "/health" and self.draining:
            return await _send_json(send, 503, _error_body("shutting down", "unavailable", "shutting_down"))
        if scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        try:
            body = await self._read_body(receive, dict(scope["headers"]))
            if body is None:
                return
            self._check(body)
            await self._admit()
        except Rejected as r:
            kind = "invalid_request_error" if r.status == 400 else "server_overloaded"
            return await _send_json(send, r.status, _error_body(r.message, kind, r.code), r.retry_after)
        try:
            await self._serve(scope, body, receive, send)
        finally:
            self._release()

    async def _serve(self, scope, body: bytes, receive, send) -> None:
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the real channel: the app sees a disconnect

        state = {"started": False, "streaming": False, "ended": False}

        async def tracked_send(message):
            if state["ended"]:
                return  # the drain has already closed this response
            if message["type"] == "http.response.start":
                state["started"] = True
                state["streaming"] = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                         for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        app = asyncio.ensure_future(self.app(scope, replay, tracked_send))
        drained = asyncio.ensure_future(self._wait_drain_deadline())
        try:
            await asyncio.wait([app, drained], return_when=asyncio.FIRST_COMPLETED)
        finally:
            drained.cancel()
        if app.done():
            return app.result()
        app.cancel()  # aborts the generation (the engine frees its KV blocks)
        await asyncio.gather(app, return_exceptions=True)
        if state["ended"]:
            return
        state["ended"] = True
        message = (f"the server shut down before this request finished (shutdown grace "
                   f"{self.limits.shutdown_grace_s:g} s); retry it")
        if state["streaming"]:
            event = json.dumps({"error": {"message": message, "type": "server_shutdown", "code": "shutting_down"}})
            await send({"type": "http.response.body", "body": f"data: {event}\n\ndata: [DONE]\n\n".encode(),
                        "more_body": False})
        elif not state["started"]:
            await _send_json(send, 503, _error_body(message, "server_shutdown", "shutting_down"), 1)
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _wait_drain_deadline(self) -> None:
        await self._drain.wait()
        await asyncio.sleep(max(0.0, self.drain_deadline - time.monotonic()))


# ---------------------------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    d = ServerLimits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get a 400")
    p.add_argument("--max-n", type=int, default=d.max_n, help="most sequences (prompts × n) per request")
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent,
                   help="generation requests served at once; more wait in the queue")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting for a slot; more get a 503")
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s,
                   help="seconds a request may wait for a slot before a 503 with Retry-After")
    p.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s,
                   help="seconds in-flight requests may run after SIGTERM before they end with an error event")


def limits_from_args(args) -> ServerLimits:
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-n", args.max_n),
                        ("--max-concurrent", args.max_concurrent)):
        if value < 1:
            raise ValueError(f"{flag} {value}: give at least 1 (every request would be refused)")
    for flag, value in (("--max-queue", args.max_queue), ("--queue-timeout", args.queue_timeout),
                        ("--shutdown-grace", args.shutdown_grace)):
        if not value >= 0:
            raise ValueError(f"{flag} {value}: give a value >= 0")
    return ServerLimits(args.max_body_bytes, args.max_n, args.max_concurrent, args.max_queue, args.queue_timeout,
                        args.shutdown_grace)


def serve(app, limits: ServerLimits, host: str, port: int, log_level: str) -> None:
    """uvicorn.run with the limits in front and SIGTERM/SIGINT starting the drain; returns (exit 0)
    once every connection has closed, at most shutdown_grace_s (+ a second for the last bytes) later."""
    import uvicorn

    guarded = LimitsMiddleware(app, limits)
    app.state.limits = guarded
    server = uvicorn.Server(uvicorn.Config(guarded, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=limits.shutdown_grace_s + 1))
    handle_exit = server.handle_exit

    def drain_then_exit(sig, frame):
        guarded.begin_drain()
        if sig == signal.SIGTERM:  # a drained stop is a clean one: exit 0 (uvicorn would re-raise the signal)
            server.should_exit = True
        else:
            handle_exit(sig, frame)  # Ctrl-C: a second one forces the exit

    server.handle_exit = drain_then_exit
    server.run()
    # The interpreter's final garbage collection walks every object the engine made (tens of
    # thousands of KV block records): on a loaded 2-core machine it ran for seconds after a SIGTERM, past
    # any grace period. Nothing left needs a finalizer run by the collector, so skip that pass.
    gc.freeze()
