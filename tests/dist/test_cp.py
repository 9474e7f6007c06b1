"""Context parallelism (parallel/cp.py): cp=2 on 2 gloo ranks trains as a single device does (loss,
grad norm and weights after 3 steps, fp32, MTP on, causal model), plus the chunking, the positions
and mask, and the layouts refused for now."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import BATCH, STEPS, batches, local_value, make_optimizer, model_config
from dist_launcher import launch

from seekforge.config import ParallelConfig
from seekforge.model.loss import lm_loss
from seekforge.model.model import build_model
from seekforge.parallel.cp import all_reduce_grads, chunk_ids, cp_lm_loss, shard_positions, shard_sequence
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.train.optim import clip_grad_norm

TOL = 1e-5  # fp32: losses, grad norms
GRAD_TOL = 1e-6  # the first step's gradients (measured 4.5e-8)
WEIGHT_TOL = 1e-5  # weights after 3 AdamW steps (dist_harness.make_optimizer says why eps is 1e-6)
SEQ = 16  # divisible by 2·cp


def test_load_balanced_chunks_and_positions():
    x = torch.arange(16)[None]
    assert chunk_ids(2, 0) == (0, 3) and chunk_ids(2, 1) == (1, 2)
    assert shard_sequence(x, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard_sequence(x, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard_positions(16, 2, 1).tolist() == list(range(4, 12))
    # every token on exactly one rank; the causal work (keys each query sees) even across ranks
    ranks = [shard_positions(24, 3, r) for r in range(3)]
    assert sorted(torch.cat(ranks).tolist()) == list(range(24))
    assert len({int((p + 1).sum()) for p in ranks}) == 1
    with pytest.raises(ValueError, match="divisible by 4"):
        shard_sequence(torch.zeros(1, 10), 2, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cp=2, dp_shard=4, ep=2, etp=2), "not supported yet"), (dict(cp=2, ep=2, ep_nodes=2), "not supported yet"),
    (dict(cp=0), "positive integer")])
def test_refused_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_world_size_counts_cp():
    assert ParallelConfig(cp=2).world_size == 2
    with pytest.raises(ValueError, match=r"\*cp\*"):
        ParallelConfig(cp=2).validate(4, model_config())


def run(cp: int, dp_shard: int = 1):
    """3 steps of the shared batches (full rows on every cp rank of a dp rank's slice): losses, grad norms,
    the first step's gradients and the weights, all full tensors."""
    cfg = model_config()
    model = build_model(cfg, seed=0)
    mesh = None
    if cp * dp_shard > 1:
        pc = ParallelConfig(cp=cp, dp_shard=dp_shard)
        mesh = build_mesh(pc, cfg)
        model = parallelize(model, pc, mesh)
    opt = make_optimizer(model.parameters())
    inputs, labels = batches(cfg, STEPS, seq=SEQ)
    rows = slice(None)
    if dp_shard > 1:
        dp_rank = mesh["dp"].get_local_rank()
        rows = slice(dp_rank * BATCH // dp_shard, (dp_rank + 1) * BATCH // dp_shard)
    losses, norms, grads = [], [], {}
    for s in range(STEPS):
        if mesh is None:
            loss, _ = lm_loss(model, inputs[s], labels[s])
            loss.backward()
        else:
            loss, _ = cp_lm_loss(model, inputs[s, rows], labels[s, rows], mesh["cp"])
            (loss * cp if dp_shard > 1 else loss).backward()  # FSDP averages over dp_shard × cp
            if dp_shard == 1:
                all_reduce_grads(model, mesh["cp"])
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # cp shares sum to a dp rank's loss; dp ranks averaged below
            loss /= dp_shard
        norms.append(clip_grad_norm(model.parameters(), float("inf")).item())
        if s == 0:
            grads = {k: local_value(p.grad).clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: local_value(v).detach().clone() for k, v in model.state_dict().items()}
    return dict(losses=losses, norms=norms, grads=grads, weights=weights)


def check(results, ref, label):
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=TOL, atol=TOL)
    assert set(results[0]["grads"]) == set(ref["grads"])
    grad_diff = max((results[0]["grads"][k] - v).abs().max().item() for k, v in ref["grads"].items())
    worst = max((results[0]["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items())
    loss_diff = max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(results[0]["norms"], ref["norms"], strict=True))
    print(f"{label}: max |loss diff| {loss_diff:.1e}, |norm diff| {norm_diff:.1e}, |step-0 grad diff| "
          f"{grad_diff:.1e}, |weight diff| {worst:.1e}")
    assert grad_diff <= GRAD_TOL
    assert worst <= WEIGHT_TOL


def test_cp2_matches_single_device():
    assert model_config().num_nextn_predict_layers == 1  # MTP on
    check(launch(run, 2, 2), run(1), "cp=2")


def test_cp2_with_fsdp2_matches_single_device():
    check(launch(run, 4, 2, 2), run(1), "cp=2 x dp_shard=2")
