"""Expert parallelism is dropless under a skewed router, equals the single-device MoE (output and
gradients), and runs the shared experts while an all-to-all is in flight, forward and backward."""

import torch
import torch.distributed as dist
from dist_harness import OverlapRecord, model_config
from dist_launcher import launch
from torch.distributed.device_mesh import init_device_mesh

from seekforge.model.moe import MoE
from seekforge.parallel.ep import apply_ep

TOKENS_PER_RANK, WORLD = 24, 2
TOL = 1e-5  # fp32; only the order of sums differs (AVX2 kernels sum in another order: 1.7e-6 seen)


def skewed_moe(cfg):
    """A MoE whose router sends most token copies to experts 0..E/2-1 (rank 0's under ep=2)."""
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        bias = torch.zeros(cfg.n_routed_experts)
        bias[: cfg.n_routed_experts // 2] = 0.25  # selection only: weights still come from raw scores
        moe.gate.e_score_correction_bias.copy_(bias)
    return moe


def inputs(cfg):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * TOKENS_PER_RANK, cfg.hidden_size, generator=g)
    probe = torch.randn(WORLD * TOKENS_PER_RANK, cfg.hidden_size, generator=g)  # loss = Σ out · probe
    return x, probe


def run_rank():
    cfg = model_config()
    rank = dist.get_rank()
    moe = skewed_moe(cfg)
    apply_ep(moe, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))["ep"])
    events = OverlapRecord(moe)

    x_all, probe_all = inputs(cfg)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x = x_all[rows].clone().requires_grad_()
    out = moe(x)
    forward_events = list(events)
    (out * probe_all[rows]).sum().backward()
    gate_grad = moe.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)  # the reference sees both ranks' tokens
    received = moe.experts.gate_up_proj.grad.to_local().shape  # this rank's experts' grads exist
    traffic = moe.dispatcher.sent_bytes, moe.dispatcher.wait_seconds  # forward only: read after backward too
    return dict(out=out.detach(), x_grad=x.grad, gate_grad=gate_grad, sent_bytes=traffic[0], wait_s=traffic[1],
                gate_up_grad=moe.experts.gate_up_proj.grad.full_tensor(),
                down_grad=moe.experts.down_proj.grad.full_tensor(),
                tokens_per_expert=moe.tokens_per_expert.clone(), local_shape=received,
                forward_events=forward_events, backward_events=events[len(forward_events):])


def test_ep_dropless_skewed_router_matches_single_device():
    cfg = model_config()
    results = launch(run_rank, WORLD)

    moe = skewed_moe(cfg)
    x, probe = inputs(cfg)
    x.requires_grad_()
    out = moe(x)
    (out * probe).sum().backward()

    counts = sum(r["tokens_per_expert"] for r in results)
    half = cfg.n_routed_experts // 2
    assert counts.sum() == WORLD * TOKENS_PER_RANK * cfg.num_experts_per_tok  # every copy routed
    assert counts[:half].sum() >= 0.75 * counts.sum(), f"router not skewed enough: {counts.tolist()}"
    torch.testing.assert_close(counts, moe.tokens_per_expert)

    close = dict(rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.cat([r["out"] for r in results]), out.detach(), **close)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in results]), x.grad, **close)
    torch.testing.assert_close(results[0]["gate_grad"], moe.gate.weight.grad, **close)
    torch.testing.assert_close(results[0]["gate_up_grad"], moe.experts.gate_up_proj.grad, **close)
    torch.testing.assert_close(results[0]["down_grad"], moe.experts.down_proj.grad, **close)
    assert results[0]["local_shape"][0] == cfg.n_routed_experts // WORLD

    # All-to-all traffic (read by probe/monitor.py): rank r sends in dispatch the copies it routed to the
    # other rank's experts, and in combine the outputs of the copies it received from the other rank.
    per_rank = [r["tokens_per_expert"] for r in results]
    owned = [slice(0, half), slice(half, None)]
    for r, result in enumerate(results):
        other = 1 - r
        rows = int(per_rank[r][owned[other]].sum() + per_rank[other][owned[r]].sum())
        assert result["sent_bytes"] == rows * cfg.hidden_size * 4, (r, result["sent_bytes"], rows)
        assert result["wait_s"] > 0

    for r in results:
        # forward: dispatch starts, shared experts run, dispatch waits; then the combine exchange.
        assert r["forward_events"] == ["start", "shared", "wait", "start", "wait"], r["forward_events"]
        # backward: combine's gradient exchange; then dispatch's starts, shared experts' backward runs
        # while it is in flight, and it finishes.
        assert r["backward_events"] == ["start", "wait", "start", "shared", "wait"], r["backward_events"]


def run_rank_probe(tmp):
    """The probe's step timer reports the EP dispatcher's waits as the phase communication_wait."""
    from seekforge.probe.config import ProbeConfig
    from seekforge.probe.training import TrainingProbe

    cfg = model_config()
    moe = skewed_moe(cfg)
    apply_ep(moe, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))["ep"])
    probe = TrainingProbe(ProbeConfig(), [moe], [torch.optim.SGD(moe.parameters(), lr=0.1)], tmp)
    x_all, _ = inputs(cfg)
    rows = slice(dist.get_rank() * TOKENS_PER_RANK, (dist.get_rank() + 1) * TOKENS_PER_RANK)
    probe.begin_step(1)
    moe(x_all[rows]).sum().backward()
    probe.mark("forward")
    waited = moe.dispatcher.wait_seconds
    probe.end_step(1, {})
    phases = {s.labels["phase"]: s.value for m in probe.registry.collect() for s in m.samples
              if s.name.endswith("_sum") and "phase" in s.labels}
    return waited, phases


def test_probe_reports_all_to_all_wait_as_a_phase(tmp_path):
    for waited, phases in launch(run_rank_probe, WORLD, str(tmp_path)):
        assert waited > 0 and phases["communication_wait"] == waited and "forward" in phases
