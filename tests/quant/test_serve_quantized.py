"""A quantized checkpoint end to end: `seekforge quantize` → `seekforge serve` → the official openai client."""

import os
import subprocess
import sys
import time

import openai
import pytest

from seekforge.config import EngineConfig
from seekforge.quant.linear import QuantExperts, QuantLinear
from seekforge.quant.load import load_model
from seekforge.serve.engine import LLM
from seekforge.serve.sequence import SamplingParams
from tests.serve.conftest import free_port, serving

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "tiny-w4a16"
    subprocess.run([sys.executable, "-m", "seekforge", "quantize", "--model", "tiny", "--scheme", "w4a16",
                    "--group-size", "32", "--method", "gptq", "--num-samples", "4", "--out", str(out)],
                   check=True, capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out


def test_engine_loads_the_checkpoint_with_quantized_linears(quantized_dir):
    model, _ = load_model(str(quantized_dir))
    assert isinstance(model.layers[0].self_attn.q_a_proj, QuantLinear)
    assert isinstance(model.layers[1].mlp.experts, QuantExperts)


def test_served_through_the_openai_client_equals_the_offline_engine(quantized_dir):
    model, tokenizer = load_model(str(quantized_dir))
    expected = LLM(model, tokenizer, num_kv_blocks=64, block_size=8).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    with serving(model, tokenizer, EngineConfig(num_kv_blocks=64, block_size=8)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected


@pytest.mark.slow
def test_seekforge_serve_cli_serves_a_quantized_checkpoint(quantized_dir):
    """The real `seekforge serve --model QUANT_DIR` process (int8 latent cache too)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "seekforge", "serve", "--model", str(quantized_dir), "--port",
                             str(port), "--dtype", "float32", "--kv-cache-dtype", "int8", "--kv-cache-memory", "8MiB"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.5)
        got = client.completions.create(model=str(quantized_dir), prompt=PROMPT, max_tokens=8, temperature=0)
        assert got.choices[0].text and got.usage.completion_tokens >= 1
        chat = client.chat.completions.create(model=str(quantized_dir), max_tokens=8,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content is not None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
