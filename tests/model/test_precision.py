"""`auto` picks bf16 on a CPU only where its native bf16 matmuls measure faster than fp32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import seekforge.model.precision as precision


@pytest.mark.parametrize("native, speedup, expected", [
    (False, 9.0, torch.float32),  # AVX2: emulated bf16, never timed
    (True, 1.6, torch.bfloat16),  # AVX512-BF16 / AMX running as it should
    (True, 0.6, torch.float32),  # flags say bf16, the measurement says fp32 is faster here
])
def test_auto_dtype_follows_the_measured_speed(monkeypatch, native, speedup, expected):
    monkeypatch.delenv("SEEKFORGE_CPU_BF16", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: speedup)
    dtype, why = precision.resolve_dtype("auto")
    assert dtype == expected
    if native:
        assert f"measured at {speedup:.2f}x fp32's speed" in why
    assert precision.resolve_dtype("bf16")[0] == torch.bfloat16  # an explicit choice is never second-guessed


def test_forced_bf16_skips_the_measurement(monkeypatch):
    monkeypatch.setenv("SEEKFORGE_CPU_BF16", "1")
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("timed a forced choice"))
    assert precision.auto_dtype() == torch.bfloat16


def test_ranks_of_one_job_decide_by_the_flags(monkeypatch):
    """Under torchrun each rank would time its own matmul (on shared cores): they could disagree."""
    monkeypatch.delenv("SEEKFORGE_CPU_BF16", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("timed under torchrun"))
    dtype, why = precision.resolve_dtype("auto")
    assert dtype == torch.bfloat16 and "not timed under torchrun" in why


def test_the_measurement_is_a_positive_ratio_taken_once():
    ratio = precision.cpu_bf16_speedup()
    assert ratio > 0 and precision.cpu_bf16_speedup() == ratio


def test_narrow_models_keep_fp32_on_a_cpu(monkeypatch, tmp_path):
    """A bf16 CPU's fast 1024³ matmul says nothing about a hidden-192 model's small ones (2x slower in bf16)."""
    from seekforge.model.load import model_width

    monkeypatch.delenv("SEEKFORGE_CPU_BF16", raising=False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 3.8)
    dtype, why = precision.resolve_dtype("auto", hidden_size=192)
    assert dtype == torch.float32 and "hidden_size 192 < 512" in why
    assert precision.resolve_dtype("auto", hidden_size=2048)[0] == torch.bfloat16
    # training, rollouts and serving alike go bf16 from 512 wide
    dtype, why = precision.resolve_dtype("auto", hidden_size=512)
    assert dtype == torch.bfloat16, why
    assert precision.resolve_dtype("auto")[0] == torch.bfloat16  # width unknown: the measurement decides
    assert precision.resolve_dtype("bf16", hidden_size=192)[0] == torch.bfloat16
    assert precision.resolve_dtype("auto", "cuda", hidden_size=192)[0] == torch.bfloat16
    (tmp_path / "config.json").write_text('{"hidden_size": 192}')
    assert model_width(str(tmp_path)) == 192 and model_width("tiny") == 64 and model_width("nowhere") is None


@pytest.mark.skipif(not precision.cpu_has_native_bf16(), reason="bf16 matmuls run on oneDNN only with native bf16")
def test_onednn_keeps_more_kernels_than_its_default():
    """Importing seekforge raises oneDNN's kernel cache to ONEDNN_CACHE_CAPACITY (unless the user set it):
    1,100 matmul shapes, over the default 1,024, are all still cached on a second pass."""
    script = """
import torch, seekforge.model.precision
w = torch.ones(8, 8, dtype=torch.bfloat16)
for n in range(1, 1101):
    torch.ones(n, 8, dtype=torch.bfloat16) @ w
print("SECOND PASS", flush=True)
for n in range(1, 1101):
    torch.ones(n, 8, dtype=torch.bfloat16) @ w
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEDNN_")}
    out = subprocess.run([sys.executable, "-c", script], env={**env, "ONEDNN_VERBOSE": "profile_create"},
                         capture_output=True, text=True, check=True).stdout
    first, second = out.split("SECOND PASS")
    assert first.count("cache_miss") > 1024  # more kernels than oneDNN keeps by default
    assert second.count("cache_miss") == 0
