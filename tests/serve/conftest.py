"""Fixtures for the serving tests: the tiny preset (fp32, random weights, byte tokenizer) and a live
server on 127.0.0.1 (free port, stopped at teardown)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from seekforge.config import EngineConfig, preset
from seekforge.model.model import build_model
from seekforge.model.tokenizer import load_tokenizer

torch.set_num_threads(1)  # the CI box is shared; small ops do not gain from more threads


@pytest.fixture(scope="session")
def tiny_model():
    return build_model(preset("tiny"), seed=0).eval()


@pytest.fixture(scope="session")
def byte_tokenizer():
    return load_tokenizer("byte")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on a background thread; `stop()` ends it."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def serving(model, tokenizer, config: EngineConfig, api_key: str | None = None):
    """A live server (model name "tiny") over a fresh engine; `.engine` is its AsyncEngine."""
    from seekforge.serve.async_engine import AsyncEngine
    from seekforge.serve.engine import LLMEngine
    from seekforge.serve.server import build_app

    engine = AsyncEngine(LLMEngine(model, tokenizer, config))
    try:
        server = LiveServer(build_app(engine, "tiny", api_key))
        server.engine = engine
        try:
            yield server
        finally:
            server.stop()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def live_server(tiny_model, byte_tokenizer):
    with serving(tiny_model, byte_tokenizer, EngineConfig(num_kv_blocks=256, block_size=8,
                                                          max_num_batched_tokens=256)) as server:
        yield server
