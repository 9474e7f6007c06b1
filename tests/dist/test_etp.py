"""Expert tensor parallelism (ParallelConfig.etp): etp=2 × ep=2 on 4 gloo ranks (dp_shard=4).

Each etp rank stores 1/etp of its experts (a contiguous Shard of the fused gate_up rows and of down's
columns). One MoE layer gives the single-device outputs and gradients; three training steps give the
single-device losses, grad norms and weights with 1/etp of an ep rank's expert bytes; checkpoints move
between etp=2 × ep=2, plain ep=2 and one device in every direction."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import (
    assert_matches_reference,
    batches,
    make_optimizer,
    model_config,
    reference_run,
    run_layout,
)
from dist_launcher import launch
from test_ep_hierarchical import reference_rank, train_rank, weight_differences
from torch.distributed.device_mesh import init_device_mesh

from seekforge.model import moe as moe_module
from seekforge.model.dtensor import local_tensor
from seekforge.model.loss import lm_loss
from seekforge.model.model import build_model
from seekforge.model.moe import MoE
from seekforge.parallel.ep import EtpDispatcher, apply_ep

WORLD, TOKENS_PER_RANK, ETP, EP = 4, 24, 2, 2
TOL = 1e-5  # fp32: losses, grad norms and weights (dist_harness.make_optimizer's eps)
ETP_LAYOUT = dict(dp_shard=4, ep=EP, etp=ETP)


def _moe(cfg):
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return moe


def ep_rank_expert_elements(cfg) -> int:
    """An ep rank's experts, whole (E/ep experts of gate_up (2I, H) and down (H, I)): what plain ep computes with."""
    return cfg.n_routed_experts // EP * 3 * cfg.moe_intermediate_size * cfg.hidden_size


def layer_rank():
    """One MoE layer: this rank's slice of the outputs and input gradients, and the expert gradients
    (gathered from the etp × ep shards), under etp=2 × ep=2 and alone; the stored expert elements."""
    cfg = model_config()
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(WORLD * TOKENS_PER_RANK, cfg.hidden_size, generator=g)
    probe = torch.randn(WORLD * TOKENS_PER_RANK, cfg.hidden_size, generator=g)
    reference = _moe(cfg)
    x_ref = x_all.clone().requires_grad_()
    out_ref = reference(x_ref)
    (out_ref * probe).sum().backward()

    mesh = init_device_mesh("cpu", (ETP, EP), mesh_dim_names=("etp", "ep"))
    moe = _moe(cfg)
    apply_ep(moe, mesh["ep"], None, mesh)
    assert isinstance(moe.dispatcher, EtpDispatcher)
    rows = slice(dist.get_rank() * TOKENS_PER_RANK, (dist.get_rank() + 1) * TOKENS_PER_RANK)
    x = x_all[rows].clone().requires_grad_()
    out = moe(x)
    (out * probe[rows]).sum().backward()
    diffs = dict(out=(out - out_ref[rows]).abs().max(), x_grad=(x.grad - x_ref.grad[rows]).abs().max())
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(moe.experts, name)
        diffs[name] = (param.full_tensor() - getattr(reference.experts, name)).abs().max()  # the stored shards
        diffs[name + ".grad"] = (param.grad.full_tensor() - getattr(reference.experts, name).grad).abs().max()
    diffs["gate_grad"] = moe.gate.weight.grad.clone()
    dist.all_reduce(diffs["gate_grad"])
    diffs["gate_grad"] = (diffs["gate_grad"] - reference.gate.weight.grad).abs().max()
    stored = sum(local_tensor(p).numel() for p in (moe.experts.gate_up_proj, moe.experts.down_proj))
    return {k: v.item() for k, v in diffs.items()} | dict(stored=stored)


def etp_train_rank(pc_kwargs: dict):
    """train_rank, recording the expert elements each GEMM call computes with (after FSDP's all-gather) and
    each rank stores between steps (FSDP-sharded)."""
    used, experts = set(), {}
    forward = moe_module.GroupedExperts.forward

    def recording(self, x, counts):
        used.add(sum(local_tensor(p).numel() for p in (self.gate_up_proj, self.down_proj)))
        experts[id(self)] = self
        return forward(self, x, counts)

    moe_module.GroupedExperts.forward = recording  # this rank's process only
    out = train_rank(pc_kwargs)
    stored = {sum(local_tensor(p).numel() for p in (m.gate_up_proj, m.down_proj)) for m in experts.values()}
    return out | dict(used=used, stored=stored)


def layer_and_train_rank():
    """One launch for both checks (each launch costs seconds of process start)."""
    return dict(layer=layer_rank(), train=etp_train_rank(ETP_LAYOUT))


@pytest.fixture(scope="module")
def etp_results():
    return launch(layer_and_train_rank, WORLD)


def test_etp_layer_matches_single_device(etp_results):
    results = [r["layer"] for r in etp_results]
    worst = {k: max(r[k] for r in results) for k in results[0] if k != "stored"}
    print("etp=2 x ep=2, one MoE layer: max |diff| " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert max(worst.values()) <= TOL, worst
    assert {r["stored"] for r in results} == {ep_rank_expert_elements(model_config()) // ETP}


def test_etp2_ep2_trains_as_single_device(etp_results):
    ref = reference_rank()
    results = [r["train"] for r in etp_results]
    assert {r["dispatcher"] for r in results} == {"EtpDispatcher"}
    diff = weight_differences(results, ref)  # losses and grad norms within TOL on every rank
    expert = max(v for k, v in diff.items() if ".experts." in k)
    loss_diff = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
    norm_diff = max(abs(a - b) for r in results for a, b in zip(r["norms"], ref["norms"], strict=True))
    print(f"etp=2 x ep=2, 3 steps: max |diff| loss {loss_diff:.1e}, grad norm {norm_diff:.1e}, "
          f"expert weights {expert:.1e}, all weights {max(diff.values()):.1e}")
    assert max(diff.values()) <= TOL
    # An ep rank's experts whole is what plain ep all-gathers to compute with; etp computes with and stores
    # 1/etp of it (dp_shard_mod_etp = 1 here: FSDP shards no further).
    whole = ep_rank_expert_elements(model_config())
    for r in results:
        assert r["used"] == {whole // ETP} and r["stored"] == {whole // ETP}, (r["used"], r["stored"], whole)
    print(f"expert elements per rank and MoE layer: {whole // ETP} of an ep rank's {whole} (ratio 1/{ETP})")


def one_device_leg(step: int, load: str | None, save: str | None) -> dict:
    """run_layout's step on one device, in this process (no process group, no spawn)."""
    from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    cfg = model_config()
    model = build_model(cfg, seed=0)
    opt = make_optimizer(model.parameters())
    out = {}
    if load is not None:
        load_checkpoint(latest_checkpoint(load), [model], [opt])
        out["loaded_weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    inputs, labels = batches(cfg, step + 1)
    loss, _ = lm_loss(model, inputs[step], labels[step])
    loss.backward()
    opt.step()
    opt.zero_grad()
    if save is not None:
        save_checkpoint(save, step + 1, [model], [opt])
    return out | dict(losses=[loss.item()], weights={k: v.detach().clone() for k, v in model.state_dict().items()})


def test_checkpoints_move_between_etp_ep_and_one_device(tmp_path):
    """One device → etp=2 × ep=2 → ep=2 → etp=2 × ep=2 → one device, a step each: every load gives exactly the
    saved weights and the chained run matches the uninterrupted single-device one."""
    chain = [(1, {}), (WORLD, ETP_LAYOUT), (2, dict(dp_shard=2, ep=EP)), (WORLD, ETP_LAYOUT), (1, {})]
    ref_losses, ref_state = reference_run(model_config(), steps=len(chain))
    saved = None
    for step, (world, layout) in enumerate(chain):
        load = str(tmp_path / f"after_{step}") if step else None
        save = str(tmp_path / f"after_{step + 1}") if step + 1 < len(chain) else None
        if world == 1:
            results = [one_device_leg(step, load, save)]
        else:
            results = launch(run_layout, world, {}, layout, (step, step + 1), load, save)
        for k, v in (saved or {}).items():
            torch.testing.assert_close(results[0]["loaded_weights"][k], v, rtol=0, atol=0, msg=k)
        saved = results[0]["weights"]
        for r in results:
            assert abs(r["losses"][0] - ref_losses[step]) <= TOL, (step, layout, r["losses"], ref_losses[step])
    worst = assert_matches_reference(results, (ref_losses[-1:], ref_state), TOL, TOL)
    print(f"one device -> etp=2 x ep=2 -> ep=2 -> etp=2 x ep=2 -> one device: max weight diff {worst:.2e}")
