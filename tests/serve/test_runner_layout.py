"""The runner's decode-only layout (plain_decode_layout) against the general one it shortcuts."""

import torch

from seekforge.config import EngineConfig
from seekforge.serve.runner import Chunk, Runner, flat_order, plain_decode_layout
from seekforge.serve.sequence import SamplingParams, Sequence


def test_plain_decode_layout_equals_general(tiny_model):
    runner = Runner(tiny_model, EngineConfig(block_size=4, num_kv_blocks=64), 64)
    chunks = []
    for n, table in [(9, [5, 2, 7]), (3, [1]), (13, [3, 4, 6, 8]), (5, [9, 10])]:
        seq = Sequence("r", 0, list(range(n)), SamplingParams(), 8, None)
        seq.block_table = table
        chunks.append(Chunk(seq, n - 1, [n - 1], decode=True))
    order = flat_order(chunks)
    fast = plain_decode_layout(order, 4)
    general = runner._layout(order)
    for a, b in zip(fast, general[:4], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert general[4] == []  # no prefill chunks
