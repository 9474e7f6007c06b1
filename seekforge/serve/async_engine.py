"""AsyncEngine: an LLMEngine (or serve/distributed.py's DistributedEngine) stepping on a background thread
for the server: `async for out in engine.generate(prompt, params)` streams cumulative RequestOutputs;
leaving the loop early (client gone) aborts the request and frees its blocks."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from seekforge.serve.engine import LLMEngine, Request, RequestOutput
from seekforge.serve.sequence import SamplingParams

log = logging.getLogger("seekforge.serve")


class AsyncEngine:
    """An LLMEngine stepping on a background thread; asyncio callers add, stream and abort requests.

    Requests and aborts reach the engine through a queue that the engine thread drains between steps,
    so the scheduler's state is only ever touched by that one thread. A failing step fails the
    requests in flight (their streams raise) and the engine keeps serving."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="seekforge-engine", daemon=True)
        self._thread.start()

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, cache_salt: str | None = None,
                 lora_name: str | None = None, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Validate now (a bad request raises ValueError here, before any streaming starts) and return
        the stream of cumulative outputs (`final_only`: the finished output alone); the request starts when the
        stream is first awaited."""
        return self._stream(self.engine.make_request(prompt, params, request_id, cache_salt, lora_name, final_only))

    async def _stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", request))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._commands.put(("abort", request.request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=10)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                # Idle: block for the next command. Busy: take what has arrived, then step.
                command = self._commands.get(timeout=0.5) if not engine.has_unfinished() else \
                    self._commands.get_nowait()
                while True:
                    kind, payload = command
                    if kind == "add":
                        try:
                            engine.add(payload)
                        except ValueError as e:
                            self._deliver(payload.request_id, e)
                    elif kind == "abort":
                        engine.abort(payload)
                    command = self._commands.get_nowait()
            except queue.Empty:
                pass
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # keep serving: fail what was in flight, free its blocks
                log.exception("engine step failed; failing %d requests", len(engine.requests))
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._deliver(request_id, RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
