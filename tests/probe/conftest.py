"""A tiny DeepSeek-V3 (MLA with q LoRA, one dense and two MoE layers, YaRN RoPE) with unit-scale
weights, and a fixed forward + backward to dump: activations are O(1), so metric thresholds mean
something (with the default 0.02 init every activation is ~0)."""

from __future__ import annotations

import pytest
import torch

from seekforge.config import ModelConfig
from seekforge.model.model import build_model
from tests.model.test_hf import randomize_  # the same weights in seekforge and transformers

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=256,
             num_nextn_predict_layers=0, rope_interleave=True,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.9,
                           "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1})
SEQ_LEN = 32


@pytest.fixture
def tiny_model():
    return randomize_(build_model(ModelConfig(**SIZES))).eval()


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (2, SEQ_LEN), generator=gen)
    weights = torch.randn(2, SEQ_LEN, SIZES["vocab_size"], generator=gen)  # a loss whose gradient is O(1)
    return ids, weights
