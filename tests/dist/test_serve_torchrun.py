"""`torchrun ... -m seekforge serve --tp 2` end to end: the official `openai` client gets the same
completions and chats (streamed and not, with logprobs) as from the single-device server on the same
checkpoint; a layout that cannot work fails before any weight is read, with the fix in the message."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from seekforge.config import EngineConfig
from seekforge.model.load import load_model
from seekforge.model.model import build_model
from tests.serve.conftest import free_port, serving

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ["--dtype", "float32", "--block-size", "8", "--kv-cache-memory", "1MiB",
               "--max-num-batched-tokens", "24"]
ENGINE = EngineConfig(block_size=8, kv_cache_memory="1MiB", max_num_batched_tokens=24)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dist_harness import model_config

    from seekforge.model.hf import save_hf

    path = tmp_path_factory.mktemp("serve_torchrun") / "tiny"
    save_hf(build_model(model_config(), seed=0), path)
    return path


def _queries(client: openai.OpenAI) -> list:
    """Completions and chats, streamed and not: what each returned (texts, finish reasons, logprobs)."""
    out = []
    greedy = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=["Hello there", "ab"], max_tokens=7, logprobs=1, **greedy)
    out.append([(c.text, c.finish_reason, c.logprobs.token_logprobs) for c in r.choices])
    stream = client.completions.create(prompt="A longer prompt that spans several blocks", max_tokens=9,
                                       stream=True, **greedy)
    out.append("".join(chunk.choices[0].text for chunk in stream))
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(messages=messages, max_tokens=6, logprobs=True, **greedy)
    out.append((r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]))
    stream = client.chat.completions.create(messages=messages, max_tokens=5, stream=True, **greedy)
    out.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    return out


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        if isinstance(w, list) and w and isinstance(w[0], tuple):  # completions with logprobs
            for (gt, gf, gl), (wt, wf, wl) in zip(g, w, strict=True):
                assert (gt, gf) == (wt, wf)
                assert gl == pytest.approx(wl, abs=1e-4)
        elif isinstance(w, tuple):
            assert g[0] == w[0] and g[1] == pytest.approx(w[1], abs=1e-4)
        else:
            assert g == w


def _torchrun_serve(checkpoint, port: int, output) -> subprocess.Popen:
    """`torchrun --nproc-per-node 2 -m seekforge serve --tp 2` on `port`, once /health answers."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "seekforge", "serve", "--model", str(checkpoint), "--served-model-name", "tiny", "--tp", "2",
               "--port", str(port), "--threads", "1", *ENGINE_ARGS]
    server = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=output, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise AssertionError("torchrun exited early" + (f":\n{server.stdout.read()}" if server.stdout else ""))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the torchrun server did not come up"
        time.sleep(0.5)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def test_openai_client_against_torchrun_tp2(checkpoint):
    port = free_port()
    server = _torchrun_serve(checkpoint, port, subprocess.PIPE)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        got = _queries(client)
    finally:
        _stop(server)
    torch.set_num_threads(1)
    model, tokenizer = load_model(str(checkpoint), torch.float32)
    with serving(model, tokenizer, ENGINE) as single:
        single_client = openai.OpenAI(base_url=single.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        want = _queries(single_client)
    _assert_same(got, want)


@pytest.mark.parametrize("world, flags, message", [
    (1, ["--tp", "2"], "--tp 2 x --dp-attention 1 = 2 ranks, but the job has world size 1; launch with "
                       "`torchrun --nproc-per-node 2"),
    (3, ["--tp", "3"], "--tp 3 does not divide num_attention_heads=4; pick tp in [1, 2, 4]"),
    (3, ["--dp-attention", "3", "--ep", "3"], "--ep 3 does not divide n_routed_experts=8"),
    (2, ["--tp", "2", "--speculative-tokens", "1"], "--speculative-tokens is not served across ranks"),
])
def test_bad_layout_fails_before_building(monkeypatch, capsys, world, flags, message):
    from seekforge import cli
    from seekforge.parallel import serving

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(serving, "build_engine_model", lambda *a, **k: pytest.fail("built before checking"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model", "tiny", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_sigterm_to_torchrun_drains_then_every_rank_exits(checkpoint, tmp_path):
    """torchrun forwards a SIGTERM to every rank. Rank 0 drains (the request in flight runs to its
    end), then stops the worker, which waited for it instead of dying at the signal and crashing rank
    0's next broadcast (issue 41, bug 6). A SIGTERM to rank 0 alone drains the same way, and then
    torchrun itself exits 0: every rank did."""
    for target in ("torchrun", "rank 0"):
        port, log_path = free_port(), tmp_path / f"{target}.log"
        with open(log_path, "w") as log:
            server = _torchrun_serve(checkpoint, port, log)
            try:
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
                    lines = r.iter_lines()
                    first = next(line for line in lines if line.startswith("data: {"))
                    rank0 = int(re.search(r"Started server process \[(\d+)\]", log_path.read_text()).group(1))
                    os.kill(server.pid if target == "torchrun" else rank0, signal.SIGTERM)
                    chunks = [first, *(line for line in lines if line.startswith("data: "))]
                returncode = server.wait(timeout=120)
            finally:
                _stop(server)
        output = log_path.read_text()
        assert chunks[-1] == "data: [DONE]" and '"finish_reason": "length"' in chunks[-2], (target, chunks[-3:])
        assert len(chunks) == 1 + 200, target  # one chunk per token, then [DONE]
        assert "rank 1: stopped by rank 0" in output, output
        assert not re.search(r"\[rank\d\]:.*(Traceback|Error)", output), output
        if target == "rank 0":
            assert returncode == 0, output
