"""`torchrun ... -m seekforge serve --tp 2` end to end: the official `openai` client gets the same
completions and chats (streamed and not, with logprobs) as from the single-device server on the same
checkpoint; a layout that cannot work fails before any weight is read, with the fix in the message."""

from __future__ import annotations

import os
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


def test_openai_client_against_torchrun_tp2(checkpoint):
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "seekforge", "serve", "--model", str(checkpoint), "--served-model-name", "tiny", "--tp", "2",
               "--port", str(port), "--threads", "1", *ENGINE_ARGS]
    server = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"torchrun exited early:\n{server.stdout.read()}"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the torchrun server did not come up"
            time.sleep(0.5)
        got = _queries(openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
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
