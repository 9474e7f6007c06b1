"""The hierarchical (node-to-node, then intra-node) expert all-to-all: the same layer outputs and
gradients as the flat all-to-all with fewer bytes across the simulated node boundary, and ep=4 over
2 nodes trains as a single device does. Nodes are simulated: 4 gloo ranks, 2 per "node"."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import (
    BATCH,
    OverlapRecord,
    batches,
    make_optimizer,
    model_config,
    resume_in_another_layout,
)
from dist_launcher import launch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from seekforge.config import ParallelConfig
from seekforge.model.loss import lm_loss
from seekforge.model.model import build_model
from seekforge.model.moe import MoE
from seekforge.parallel.ep import HierarchicalDispatcher, apply_ep, nodes_per_token
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.train.optim import clip_grad_norm

WORLD, NODES, TOKENS_PER_RANK, STEPS = 4, 2, 24, 3
TOL = 1e-5  # fp32


def layer_run(cfg_overrides: dict, hierarchical: bool):
    """One MoE layer on every rank's slice of the same tokens: output, grads, traffic."""
    cfg = model_config(**cfg_overrides)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    nodes = world._unflatten(0, (NODES, WORLD // NODES), ("ep_node", "ep_local"))
    apply_ep(moe, world, nodes if hierarchical else None)
    assert isinstance(moe.dispatcher, HierarchicalDispatcher) == hierarchical
    events = OverlapRecord(moe)
    if not hierarchical:
        moe.dispatcher.ranks_per_node = WORLD // NODES  # count what would cross the same node boundary
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(WORLD * TOKENS_PER_RANK, cfg.hidden_size, generator=g)
    probe = torch.randn(WORLD * TOKENS_PER_RANK, cfg.hidden_size, generator=g)
    rows = slice(dist.get_rank() * TOKENS_PER_RANK, (dist.get_rank() + 1) * TOKENS_PER_RANK)
    x = x_all[rows].clone().requires_grad_()
    out = moe(x)
    forward_bytes, forward_events = moe.dispatcher.cross_node_bytes, list(events)
    (out * probe[rows]).sum().backward()
    events.stop()
    gate_grad = moe.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)
    return dict(out=out.detach(), x_grad=x.grad, gate_grad=gate_grad, cross=forward_bytes,
                forward_events=forward_events, backward_events=events[len(forward_events):],
                gate_up_grad=moe.experts.gate_up_proj.grad.full_tensor(),
                down_grad=moe.experts.down_proj.grad.full_tensor())


def both_dispatchers(cfg_overrides: dict):
    return layer_run(cfg_overrides, False), layer_run(cfg_overrides, True)


@pytest.mark.parametrize("overrides", [{}, dict(topk_group=2)], ids=["node-limited", "unlimited"])
def test_hierarchical_equals_flat_with_fewer_cross_node_bytes(overrides):
    cfg = model_config(**overrides)
    results = launch(both_dispatchers, WORLD, overrides)
    for key in ("out", "x_grad"):
        flat, hier = (torch.cat([r[i][key] for r in results]) for i in (0, 1))
        torch.testing.assert_close(hier, flat, rtol=TOL, atol=TOL)
        print(f"{key}: max |hierarchical - flat| = {(hier - flat).abs().max().item():.1e}")
    for key in ("gate_grad", "gate_up_grad", "down_grad"):
        torch.testing.assert_close(results[0][1][key], results[0][0][key], rtol=TOL, atol=TOL)
    flat_bytes = sum(r[0]["cross"] for r in results)
    hier_bytes = sum(r[1]["cross"] for r in results)
    print(f"{overrides or 'tiny'}: cross-node bytes of one layer's forward, all ranks: flat {flat_bytes}, "
          f"hierarchical {hier_bytes}")
    assert 0 < hier_bytes < flat_bytes
    # Each direction moves at most one row per (token, other node) the token reaches.
    limit = nodes_per_token(cfg, NODES)
    assert hier_bytes <= 2 * WORLD * TOKENS_PER_RANK * limit * cfg.hidden_size * 4
    for _, hier in results:
        # The node-crossing exchange is in flight while the shared experts run, forward and backward.
        assert hier["forward_events"][:3] == ["start", "shared", "wait"], hier["forward_events"]
        assert hier["backward_events"][-3:] == ["start", "shared", "wait"], hier["backward_events"]


def train_rank(pc_kwargs: dict):
    """Steps of the shared data under pc_kwargs: dp-averaged losses, grad norms, full weights."""
    cfg = model_config()
    pc = ParallelConfig(**pc_kwargs)
    mesh = build_mesh(pc, cfg)
    model = parallelize(build_model(cfg, seed=0), pc, mesh)
    opt = make_optimizer(model.parameters())
    inputs, labels = batches(cfg, STEPS)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses, norms = [], []
    for s in range(STEPS):
        loss, _ = lm_loss(model, inputs[s, rows], labels[s, rows])
        loss.backward()
        norms.append(clip_grad_norm(model.parameters(), float("inf")).item())  # the trainer's norm; no clipping
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / dp)
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
               for k, v in model.state_dict().items()}
    return dict(losses=losses, norms=norms, weights=weights,
                dispatcher=type(next(m for m in model.modules() if isinstance(m, MoE)).dispatcher).__name__)


def reference_rank():
    cfg = model_config()
    model = build_model(cfg, seed=0)
    opt = make_optimizer(model.parameters())
    inputs, labels = batches(cfg, STEPS)
    losses, norms = [], []
    for s in range(STEPS):
        loss, _ = lm_loss(model, inputs[s], labels[s])
        loss.backward()
        norms.append(clip_grad_norm(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, norms=norms, weights={k: v.detach().clone() for k, v in model.state_dict().items()})


def weight_differences(results, ref) -> dict[str, float]:
    """train_rank's results against reference_rank's: every rank's losses and grad norms within TOL; → per weight
    the largest |difference| of rank 0's final weights."""
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=TOL, atol=TOL)
    state = results[0]["weights"]
    assert set(state) == set(ref["weights"])
    return {k: (state[k] - ref["weights"][k]).abs().max().item() for k in state}


def test_ep4_over_2_nodes_matches_single_device():
    ref = reference_rank()
    results = launch(train_rank, WORLD, dict(dp_shard=4, ep=4, ep_nodes=2))
    assert {r["dispatcher"] for r in results} == {"HierarchicalDispatcher"}
    worst = max(weight_differences(results, ref).values())
    print(f"losses {results[0]['losses']}, grad norms {results[0]['norms']}, max |weight - reference| {worst:.1e}")
    assert worst <= TOL


def test_checkpoint_saved_over_2_nodes_resumes_flat(tmp_path):
    """The expert weights are the same ep-sharded DTensors either way: a checkpoint saved under
    ep=4 over 2 nodes resumes under flat ep=2, and the continued run matches the uninterrupted one."""
    worst = resume_in_another_layout(tmp_path, (WORLD, dict(dp_shard=4, ep=4, ep_nodes=2)), (2, dict(dp_shard=2, ep=2)),
                                     TOL, TOL)
    print(f"resumed flat from the 2-node layout: max weight diff {worst:.2e}")
