"""Context parallelism composed with the other dimensions (parallel/cp.py): cp=2 × tp=2 trains as a single
device does (loss, grad norm and weights after 3 steps, fp32, MTP on)."""

import torch
import torch.distributed as dist
from dist_harness import BATCH, STEPS, batches, local_value, make_optimizer, model_config
from dist_launcher import launch

from seekforge.config import ParallelConfig
from seekforge.model.dtensor import plain_tensor
from seekforge.model.loss import lm_loss
from seekforge.model.model import build_model
from seekforge.parallel.cp import all_reduce_grads, cp_lm_loss
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize, uses_fsdp
from seekforge.parallel.tp import loss_context
from seekforge.train.optim import clip_grad_norm

TOL = 1e-5  # fp32: losses, grad norms
# Weights after 3 AdamW steps: 1e-4, as test_cp.py (AdamW's first steps move a near-zero gradient element by
# ~lr whatever its size, so fp32 reduction-order noise in such an element shows up at ~1e-5).
WEIGHT_TOL = 1e-4
SEQ = 16  # divisible by 2·cp


def run(pc_kwargs: dict | None):
    """3 steps of the shared batches (each dp rank's rows, full rows on every cp rank): per-step losses (the
    global batch's), grad norms, and the full weights. pc_kwargs None: the single device."""
    cfg = model_config()
    model = build_model(cfg, seed=0)
    inputs, labels = batches(cfg, STEPS, seq=SEQ)
    pc = mesh = None
    if pc_kwargs is not None:
        pc = ParallelConfig(**pc_kwargs)
        mesh = build_mesh(pc, cfg)
        model = parallelize(model, pc, mesh)
    opt = make_optimizer(model.parameters())  # after parallelize: TP swaps the parameters for DTensors
    losses, norms = [], []
    for s in range(STEPS):
        if pc is None:
            loss, _ = lm_loss(model, inputs[s], labels[s])
            loss.backward()
        else:
            loss = cp_step(model, pc, mesh, inputs[s], labels[s])
        norms.append(clip_grad_norm(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    weights = {k: local_value(v).detach().clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, norms=norms, weights=weights)


def cp_step(model, pc, mesh, inputs, labels) -> float:
    """Forward and backward of this dp rank's rows under cp: FSDP (when it shards) averages the gradients over
    dp × cp, so backward cp · share; without it the cp ranks' gradients are summed here. → the global loss."""
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    with loss_context(mesh["tp"]):
        loss, _ = cp_lm_loss(model, inputs[rows], labels[rows], mesh["cp"])
        (loss * pc.cp if uses_fsdp(pc) else loss).backward()
    if not uses_fsdp(pc):
        all_reduce_grads(model, mesh["cp"])
    loss = plain_tensor(loss.detach()).clone()
    dist.all_reduce(loss)  # cp shares sum to a dp rank's loss; dp ranks and tp replicas averaged
    return loss.item() / (dp * pc.tp)


def check(results, ref, label):
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=TOL, atol=TOL)
    worst = max((results[0]["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items())
    loss_diff = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
    norm_diff = max(abs(a - b) for r in results for a, b in zip(r["norms"], ref["norms"], strict=True))
    print(f"{label}: max |loss diff| {loss_diff:.1e}, |grad norm diff| {norm_diff:.1e}, |weight diff| {worst:.1e}")
    assert worst <= WEIGHT_TOL


def test_cp2_tp2_matches_single_device():
    check(launch(run, 4, dict(cp=2, tp=2)), run(None), "cp=2 x tp=2")


def test_cp2_tp2_sequence_parallel_matches_single_device():
    check(launch(run, 4, dict(cp=2, tp=2, sequence_parallel=True)), run(None), "cp=2 x tp=2 (sequence parallel)")


def test_cp2_hsdp_matches_single_device():
    check(launch(run, 4, dict(cp=2, dp_replicate=2)), run(None), "cp=2 x dp_replicate=2")
