"""Ring attention (parallel/cp.py's _RingAttention) against its simple references: the all-gather path
(GatheredAttention) and one device's causal attention over the whole row — outputs and the gradients of
q, the latents and kv_b_proj's weight, fp32 at cp=2 and cp=4, and bf16 within bf16's own error; the model
trained on cp=4 as on one device, in bf16 (FSDP's mixed precision over the cp ranks) as the all-gather path;
and the issue's memory must-show: 2,048 tokens on cp=4 ranks in ≤ 0.3 × one device's activation memory."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import STEPS, batches, make_optimizer, model_config
from dist_launcher import launch
from test_cp import SEQ, check, run

from seekforge.model.model import MLA
from seekforge.parallel.cp import ContextParallelAttention, GatheredAttention, shard_positions, shard_sequence

TOL = 1e-5  # fp32


def attention_inputs(seq: int, dtype=torch.float32):
    """One MLA (seed 0) and a batch of 2 rows: q_nope, q_pe (B, T, nh, ·), c_kv (B, T, r), k_pe (B, T, dr)."""
    cfg = model_config()
    torch.manual_seed(0)
    attn = MLA(cfg).to(dtype)
    g = torch.Generator().manual_seed(1)
    b, nh = 2, cfg.num_attention_heads
    shapes = [(b, seq, nh, cfg.qk_nope_head_dim), (b, seq, nh, cfg.qk_rope_head_dim), (b, seq, cfg.kv_lora_rank),
              (b, seq, cfg.qk_rope_head_dim)]
    return attn, [torch.randn(s, generator=g).to(dtype) for s in shapes]


def attend_and_grad(attn, inputs, attention):
    """Output (B, T', nh·dv) and the gradients of the inputs and of kv_b_proj's weight for a fixed upstream
    gradient (the same random (B, T, nh·dv) on every layout, sharded like the output)."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    attn.zero_grad()
    if attention is None:
        out = attn.attend_naive(*inputs, is_causal=True)
    else:
        out = attention.attend(attn, *inputs)
    upstream = torch.randn(out.shape[0], out.shape[1] * (1 if attention is None else attention.cp), out.shape[2],
                           generator=torch.Generator().manual_seed(2)).to(out.dtype)
    if attention is not None:
        upstream = shard_sequence(upstream, attention.cp, attention.rank)
    (out.float() * upstream.float()).sum().backward()
    return out.detach(), [x.grad for x in inputs], attn.kv_b_proj.weight.grad.clone()


def run_ring(seq: int, dtype_name: str):
    """On each cp rank: (ring, gathered) outputs and gradients of this rank's shard, plus the weight grads
    summed over the ranks."""
    dtype = getattr(torch, dtype_name)
    cp, rank = dist.get_world_size(), dist.get_rank()
    attn, inputs = attention_inputs(seq, dtype)
    local = [shard_sequence(x, cp, rank) for x in inputs]
    pos = shard_positions(seq, cp, rank)
    results = {}
    for name, cls in (("ring", ContextParallelAttention), ("gathered", GatheredAttention)):
        attention = cls(dist.group.WORLD, pos)
        attention.cp, attention.rank = cp, rank
        out, grads, grad_w = attend_and_grad(attn, local, attention)
        dist.all_reduce(grad_w)
        results[name] = dict(out=out, grads=grads, grad_w=grad_w)
    return results


def max_diffs(results, name, ref, cp):
    """Largest |ring − ref| over the ranks: output, input gradients, weight gradient (relative to its size)."""
    out, grads, grad_w = ref
    d_out = max((r[name]["out"].float() - shard_sequence(out, cp, i)).abs().max().item() for i, r in enumerate(results))
    d_grad = max((a.float() - shard_sequence(b, cp, i)).abs().max().item()
                 for i, r in enumerate(results) for a, b in zip(r[name]["grads"], grads, strict=True))
    d_w = max(((r[name]["grad_w"].float() - grad_w).abs().max() / grad_w.abs().max()).item() for r in results)
    return d_out, d_grad, d_w


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_matches_gathered_and_single_device_fp32(cp):
    results = launch(run_ring, cp, 32, "float32")
    attn, inputs = attention_inputs(32)
    single = attend_and_grad(attn, inputs, None)
    gathered = [(r["gathered"]["out"], r["gathered"]["grads"], r["gathered"]["grad_w"]) for r in results]
    for i, r in enumerate(results):  # ring against the all-gather path, rank by rank
        torch.testing.assert_close(r["ring"]["out"], gathered[i][0], rtol=0, atol=TOL)
        for a, b in zip(r["ring"]["grads"], gathered[i][1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)
        torch.testing.assert_close(r["ring"]["grad_w"], gathered[i][2], rtol=TOL, atol=TOL)
    d_out, d_grad, d_w = max_diffs(results, "ring", single, cp)
    print(f"cp={cp} ring vs single device: |out| {d_out:.1e}, |input grads| {d_grad:.1e}, "
          f"|weight grad| / max {d_w:.1e}")
    assert max(d_out, d_grad, d_w) <= TOL


def test_ring_bf16_within_bf16_error():
    """bf16: the ring (fp32 softmax merge) is no further from the fp32 truth than the all-gather path in bf16."""
    results = launch(run_ring, 2, 32, "bfloat16")
    attn, inputs = attention_inputs(32)
    truth = attend_and_grad(attn, inputs, None)
    ring, gathered = max_diffs(results, "ring", truth, 2), max_diffs(results, "gathered", truth, 2)
    print(f"bf16 vs fp32 truth (out, input grads, weight grad / max): ring {ring}, gathered {gathered}")
    for r, g in zip(ring, gathered, strict=True):
        assert r <= 2 * g + 1e-3  # measured: ring 1.5e-2 vs 9.7e-3 on the input grads (delta uses the bf16 output)


LONG = 2048  # the must-show: a 2,048-token row on cp=4 ranks
LONG_CONFIG = dict(num_hidden_layers=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
                   num_nextn_predict_layers=0, max_position_embeddings=LONG)  # one dense layer, one MoE; no MTP


def activation_bytes(cp: int, attention_cls=None) -> dict:
    """One training step of a 2,048-token row (after a first step made the gradients and AdamW states):
    peak live tensor bytes (plan/measure.LiveBytes) minus what was live before it (parameters, gradients,
    optimizer states) — the step's activations and workspace, on this rank. cp = 1: one device, lm_loss."""
    from seekforge.model.loss import lm_loss
    from seekforge.model.model import build_model
    from seekforge.parallel import cp as cp_module
    from seekforge.parallel.cp import all_reduce_grads, cp_lm_loss
    from seekforge.parallel.mesh import build_mesh
    from seekforge.plan.measure import LiveBytes, state_tensors

    cfg = model_config(**LONG_CONFIG)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (1, LONG + 1), generator=torch.Generator().manual_seed(0))
    if cp > 1:
        from seekforge.config import ParallelConfig

        cp_mesh = build_mesh(ParallelConfig(cp=cp), cfg)["cp"]
        if attention_cls is not None:  # the all-gather reference, for the report
            cp_module.ContextParallelAttention = attention_cls

    def step():
        if cp == 1:
            loss, _ = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
        else:
            loss, _ = cp_lm_loss(model, tokens[:, :-1], tokens[:, 1:], cp_mesh)
        loss.backward()
        if cp > 1:
            all_reduce_grads(model, cp_mesh)
        return loss.detach()

    step()
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients stay state, as the parameters and AdamW's moments
    tracker = LiveBytes(state_tensors([model], [opt]))
    with tracker:
        state = tracker.live
        step()
    return dict(activations=tracker.peak - state, state=state)


def test_cp4_trains_2048_tokens_in_under_03x_the_activation_memory():
    """The issue's must-show: per-rank activation memory ≤ 0.3 × one device's on a 2,048-token row, cp=4.
    One device holds every layer's (T, T) probabilities for backward; a ring rank holds its T/cp tokens'
    activations, one visiting block's keys and values and one (T/2cp)² tile at a time."""
    single = activation_bytes(1)["activations"]
    ranks = [r["activations"] for r in launch(activation_bytes, 4, 4)]
    ratio = max(ranks) / single
    print(f"2,048 tokens, activations: one device {single / 2**20:.1f} MiB, cp=4 ring per rank "
          f"{max(ranks) / 2**20:.1f} MiB, ratio {ratio:.3f}")
    assert ratio <= 0.3


def test_cp4_matches_single_device():
    check(launch(run, 4, 4), run(1), "cp=4")


def run_bf16(gathered: bool):
    """3 steps of cp=2 under mixed_precision=bf16 (FSDP over the cp ranks, bf16 compute): the losses, with
    the ring or the all-gather reference as every layer's attention."""
    from seekforge.config import ParallelConfig
    from seekforge.model.model import build_model
    from seekforge.parallel import cp as cp_module
    from seekforge.parallel.cp import GatheredAttention, cp_lm_loss
    from seekforge.parallel.mesh import build_mesh
    from seekforge.parallel.parallelize import parallelize

    if gathered:
        cp_module.ContextParallelAttention = GatheredAttention
    cfg, pc = model_config(), ParallelConfig(cp=2, mixed_precision="bf16")
    mesh = build_mesh(pc, cfg)
    model = parallelize(build_model(cfg, seed=0), pc, mesh)
    opt = make_optimizer(model.parameters())
    inputs, labels = batches(cfg, STEPS, seq=SEQ)
    losses = []
    for s in range(STEPS):
        loss, _ = cp_lm_loss(model, inputs[s], labels[s], mesh["cp"])
        (loss * 2).backward()  # FSDP averages over the cp ranks
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float()
        dist.all_reduce(loss)
        losses.append(loss.item())
    return losses


def test_cp2_bf16_ring_as_gathered():
    """bf16: the ring trains as the all-gather path does, within bf16's rounding, and near fp32's losses."""
    ring, gathered = launch(run_bf16, 2, False)[0], launch(run_bf16, 2, True)[0]
    fp32 = run(1)["losses"]
    diff = max(abs(a - b) for a, b in zip(ring, gathered, strict=True))
    to_fp32 = max(abs(a - b) for a, b in zip(ring, fp32, strict=True))
    print(f"cp=2 bf16: ring {ring}, gathered {gathered}; max |ring − gathered| {diff:.1e}, "
          f"|ring − fp32 single device| {to_fp32:.1e}")
    assert diff <= 2e-3 and to_fp32 <= 1e-2  # measured 1.5e-4 and 2.7e-4


def run_ring_tp(seq: int):
    """cp=2 × tp=2 (mesh cp × tp), kv_b_proj colwise as parallel/tp.py shards it (this rank's heads): the
    ring's output for this rank's tokens and heads, and the gradients summed as the model's hooks sum them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp, rank, tp, tp_rank = 2, mesh["cp"].get_local_rank(), 2, mesh["tp"].get_local_rank()
    attn, inputs = attention_inputs(seq)
    nh = attn.num_heads
    parallelize_module(attn, mesh["tp"], {"kv_b_proj": ColwiseParallel()})
    attn.num_heads = nh // tp
    heads = slice(tp_rank * nh // tp, (tp_rank + 1) * nh // tp)
    q_nope, q_pe, c_kv, k_pe = (shard_sequence(x, cp, rank).detach() for x in inputs)
    local = [q_nope[:, :, heads].requires_grad_(), q_pe[:, :, heads].requires_grad_(), c_kv.requires_grad_(),
             k_pe.requires_grad_()]
    out = ContextParallelAttention(mesh["cp"].get_group(), shard_positions(seq, cp, rank)).attend(attn, *local)
    upstream = torch.randn(2, seq, nh * attn.cfg.v_head_dim, generator=torch.Generator().manual_seed(2))
    upstream = shard_sequence(upstream, cp, rank).view(*out.shape[:2], nh, -1)[:, :, heads].flatten(2)
    (out * upstream).sum().backward()
    grad_k_pe = local[3].grad.clone()  # this rank's heads' share: tp.py's hook on kv_a_proj sums it over TP
    dist.all_reduce(grad_k_pe, group=mesh["tp"].get_group())
    grad_w = attn.kv_b_proj.weight.grad.full_tensor()
    dist.all_reduce(grad_w, group=mesh["cp"].get_group())
    return dict(rank=rank, heads=heads, out=out.detach(), grads=[local[0].grad, local[1].grad, local[2].grad,
                                                                 grad_k_pe], grad_w=grad_w)


def test_ring_with_tp_local_heads():
    """Under TP an MLA holds its local heads (kv_b_proj a colwise DTensor): the ring expands and
    differentiates through the module, so its output and gradients are the single device's, per head."""
    attn, inputs = attention_inputs(16)
    out, grads, grad_w = attend_and_grad(attn, inputs, None)
    for r in launch(run_ring_tp, 4, 16):
        want = shard_sequence(out, 2, r["rank"])  # (B, T/cp, nh·dv) → this rank's heads
        want = want.view(*want.shape[:2], attn.num_heads, -1)[:, :, r["heads"]].flatten(2)
        torch.testing.assert_close(r["out"], want, rtol=0, atol=TOL)
        for got, want in zip(r["grads"], grads, strict=True):
            want = shard_sequence(want, 2, r["rank"])
            torch.testing.assert_close(got, want[:, :, r["heads"]] if want.dim() == 4 else want, rtol=0, atol=TOL)
        torch.testing.assert_close(r["grad_w"], grad_w, rtol=TOL, atol=TOL)
