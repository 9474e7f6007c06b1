"""Ring attention under bf16 autocast over fp32 weights (pretrain's --dtype bf16 without FSDP's bf16 policy,
e.g. --parallel cp=2 alone): the backward re-expands the visiting latent blocks through kv_b_proj, so it must
run under forward's autocast state, or the fp32 keys meet the bf16 queries (parallel/cp.py's _RingAttention).
Checked against the all-gather reference under the same autocast, within bf16's rounding."""

import torch
import torch.distributed as dist
from dist_launcher import launch
from test_cp_ring import attention_inputs

from seekforge.parallel.cp import ContextParallelAttention, GatheredAttention, shard_positions, shard_sequence

SEQ = 32


def run_autocast():
    """On each of 2 cp ranks: (ring, gathered) output and input gradients of this rank's shard, forward under
    autocast and backward outside it, as the Trainer runs them. Inputs as the model makes them: q and k_pe
    from bf16 matmuls, c_kv from an fp32-weighted norm."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    attn, inputs = attention_inputs(SEQ)
    inputs = [inputs[0].bfloat16(), inputs[1].bfloat16(), inputs[2], inputs[3].bfloat16()]
    local = [shard_sequence(x, cp, rank) for x in inputs]
    upstream = shard_sequence(torch.randn(2, SEQ, attn.num_heads * attn.cfg.v_head_dim,
                                          generator=torch.Generator().manual_seed(2)), cp, rank)
    results = {}
    for name, cls in (("ring", ContextParallelAttention), ("gathered", GatheredAttention)):
        xs = [x.detach().requires_grad_() for x in local]
        attention = cls(dist.group.WORLD, shard_positions(SEQ, cp, rank))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attention.attend(attn, *xs)
        (out.float() * upstream).sum().backward()
        results[name] = [out.detach().float(), *(x.grad.float() for x in xs)]
    return results


def test_ring_under_autocast_as_gathered():
    for r in launch(run_autocast, 2):
        for a, b in zip(r["ring"], r["gathered"], strict=True):
            assert a.dtype == b.dtype and torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=0, atol=5e-2)  # bf16 rounding of O(1) values
