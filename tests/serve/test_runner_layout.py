"""The runner's decode-only layout (plain_decode_layout) against the general one it shortcuts."""

import torch

from seekforge.config import EngineConfig
from seekforge.serve.runner import Chunk, Runner, decode_key_mask, flat_order, plain_decode_layout
from seekforge.serve.sequence import SamplingParams, Sequence


def test_plain_decode_layout_equals_general(tiny_model):
    runner = Runner(tiny_model, EngineConfig(block_size=4, num_kv_blocks=64), 64)
    chunks = []
    for n, table in [(9, [5, 2, 7]), (3, [1]), (13, [3, 4, 6, 8]), (5, [9, 10])]:
        seq = Sequence("r", 0, list(range(n)), SamplingParams(), 8, None)
        seq.block_table = table
        chunks.append(Chunk(seq, n - 1, [n - 1], decode=True))
    order = flat_order(chunks)
    ids, *fast = plain_decode_layout(order, 4)
    general = runner._layout(order)
    for a, b in zip(fast, general[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ids.tolist() == [[c.token_ids[0] for c in order]]
    torch.testing.assert_close(decode_key_mask(fast[0], fast[2].shape[1] * 4), general[3], rtol=0, atol=0)
    assert general[4] == []  # no prefill chunks
