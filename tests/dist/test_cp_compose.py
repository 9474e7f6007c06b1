"""Context parallelism composed with the other dimensions (parallel/cp.py): cp=2 × tp=2 trains as a single
device does (loss, grad norm and weights after 3 steps, fp32, MTP on)."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import BATCH, STEPS, batches, full_state, make_optimizer, model_config
from dist_launcher import launch

from seekforge.config import ParallelConfig
from seekforge.model.dtensor import plain_tensor
from seekforge.model.loss import lm_loss
from seekforge.model.model import build_model
from seekforge.model.moe import MoE
from seekforge.parallel import cp
from seekforge.parallel.cp import all_reduce_grads, cp_lm_loss
from seekforge.parallel.layout import describe_layout, layout_of_model
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.parallel.tp import loss_context
from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from seekforge.train.optim import clip_grad_norm

TOL = 1e-5  # fp32: losses, grad norms
WEIGHT_TOL = 1e-5  # weights after 3 AdamW steps (dist_harness.make_optimizer says why eps is 1e-6)
SEQ = 16  # divisible by 2·cp


AUX_LOSS_COEFF = 0.01  # the sequence-wise balance loss, weighted enough to move the routers


def with_balance_loss(model):
    for moe in model.moe_layers():
        moe.aux_loss_coeff = AUX_LOSS_COEFF
    return model


def run(pc_kwargs: dict | None, steps: tuple[int, int] = (0, STEPS), load: str | None = None,
        save: str | None = None, save_at: int | None = None):
    """Steps [start, stop) of the shared batches (each dp rank's rows, full rows on every cp rank), optionally
    resumed from the checkpoint root `load` and saved to `save` after step `save_at` (default: the last) through
    train/checkpoint.py: per-step losses (the
    global batch's), grad norms, the full weights (also right after loading), and whether the model's Layout is
    the described one. pc_kwargs None: the single device."""
    cfg = model_config()
    model = with_balance_loss(build_model(cfg, seed=0))
    inputs, labels = batches(cfg, STEPS, seq=SEQ)
    pc = mesh = None
    out = {}
    if pc_kwargs is not None:
        pc = ParallelConfig(**pc_kwargs)
        mesh = build_mesh(pc, cfg)
        model = parallelize(model, pc, mesh)
        for moe in model.moe_layers():  # its share, scaled as the other loss terms (the trainer does the same)
            moe.aux_grad_scale = cp.grad_scale(model, mesh["cp"]) if pc.cp > 1 else 1
        described, found = describe_layout(cfg, pc), layout_of_model(model)
        out["layout_ok"] = found.tensors.keys() == described.tensors.keys() and all(
            found.tensors[n].pieces() == t.pieces() for n, t in described.tensors.items())
    opt = make_optimizer(model.parameters())  # after parallelize: TP swaps the parameters for DTensors
    if load is not None:
        load_checkpoint(latest_checkpoint(load), model, opt)
        out["loaded_weights"] = full_state([model], [opt])[0]
    losses, norms = [], []
    for s in range(*steps):
        if pc is None:
            loss, _ = lm_loss(model, inputs[s], labels[s])
            loss.backward()
            loss = loss.item()
        else:
            loss = parallel_step(model, pc, mesh, inputs[s], labels[s])
        norms.append(clip_grad_norm(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        if save is not None and s + 1 == (save_at or steps[1]):
            save_checkpoint(save, s + 1, model, opt)
    out.update(losses=losses, norms=norms, weights=full_state([model], [opt])[0])
    return out


def parallel_step(model, pc, mesh, inputs, labels) -> float:
    """Forward and backward of this dp rank's rows. Under cp: FSDP (when it shards) averages the gradients over
    dp × cp, so backward cp · share; without it the cp ranks' gradients are summed here. → the global loss."""
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    with loss_context(mesh["tp"]):
        if pc.cp == 1:
            loss, _ = lm_loss(model, inputs[rows], labels[rows])
            loss.backward()
        else:
            loss, _ = cp_lm_loss(model, inputs[rows], labels[rows], mesh["cp"])
            (loss * pc.cp if pc.fsdp else loss).backward()
    if pc.cp > 1 and not pc.fsdp:
        all_reduce_grads(model, mesh["cp"])
    loss = plain_tensor(loss.detach()).clone()
    dist.all_reduce(loss)  # cp shares sum to a dp rank's loss; dp ranks and tp replicas averaged
    return loss.item() / (dp * pc.tp)


def check(results, ref, label, first: int = 0):
    """Every rank's losses and grad norms of steps [first, STEPS) and rank 0's final weights match the reference's."""
    ref_losses, ref_norms = ref["losses"][first:], ref["norms"][first:]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=0, atol=TOL)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=TOL, atol=TOL)
        assert r.get("layout_ok", True), f"{label}: layout_of_model != describe_layout"
    assert results[0]["weights"].keys() == ref["weights"].keys()
    worst = max((results[0]["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items())
    loss_diff = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref_losses, strict=True))
    norm_diff = max(abs(a - b) for r in results for a, b in zip(r["norms"], ref_norms, strict=True))
    print(f"{label}: max |loss diff| {loss_diff:.1e}, |grad norm diff| {norm_diff:.1e}, |weight diff| {worst:.1e}")
    assert worst <= WEIGHT_TOL


def run_pipeline(pc_kwargs: dict):
    """3 steps under a pipeline (parallel/pp.py) with cp: losses from the last stage, grad norms over the stages,
    the full weights of this rank's stages."""
    from seekforge.parallel.pp import PipelineRunner

    cfg, pc = model_config(), ParallelConfig(**pc_kwargs)
    inputs, labels = batches(cfg, STEPS, seq=SEQ)
    mesh = build_mesh(pc, cfg)
    runner = PipelineRunner(with_balance_loss(build_model(cfg, seed=0)), pc, mesh)
    for moe in [m for stage in runner.modules for m in stage.modules() if isinstance(m, MoE)]:
        moe.aux_grad_scale = cp.grad_scale(runner.modules[0], mesh["cp"]) / pc.microbatches
    optimizers = [make_optimizer(m.parameters()) for m in runner.modules]
    duplicates = {id(p) for m in runner.modules if m.is_last and not m.is_first for p in m.embed_tokens.parameters()}
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses, norms = [], []
    for s in range(STEPS):
        parts = runner.step(inputs[s, rows], labels[s, rows])
        runner.sync_tied_embedding_grads()
        cp.reduce_grads(runner.modules, mesh["cp"])
        norms.append(clip_grad_norm(runner.parameters(), float("inf"), mesh["pp"].get_group(), duplicates).item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        loss = parts["loss"].clone() if parts else torch.zeros(())  # the last stage's cp shares
        dist.all_reduce(loss)
        losses.append(loss.item() / (dp * pc.tp))
    return dict(losses=losses, norms=norms, weights=full_state(runner.modules, optimizers)[0])


def test_cp2_pp2_matches_single_device(reference):
    results = launch(run_pipeline, 4, dict(cp=2, pp=2, microbatches=2))
    weights = {k: v for r in results for k, v in r["weights"].items()}
    check([dict(r, weights=weights) for r in results], reference, "cp=2 x pp=2 (1F1B, 2 micro-batches)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single device's 3 steps, its step-1 checkpoint under root/checkpoints."""
    root = tmp_path_factory.mktemp("single")
    return dict(run(None, save=str(root / "checkpoints"), save_at=1), root=root)


def test_cp2_tp2_matches_single_device_and_resumes_on_it(reference, tmp_path):
    """3 steps under cp=2 × tp=2, then its step-2 checkpoint continues on one device."""
    check(launch(run, 4, dict(cp=2, tp=2), (0, STEPS), None, str(tmp_path), 2), reference, "cp=2 x tp=2")
    resumed = run(None, (2, STEPS), str(tmp_path))
    check([resumed], reference, "cp=2 x tp=2 step 2 → single device", first=2)


def test_single_device_checkpoint_resumes_under_cp2_tp2_sequence_parallel(reference):
    resumed = launch(run, 4, dict(cp=2, tp=2, sequence_parallel=True), (1, STEPS),
                     str(reference["root"] / "checkpoints"))
    check(resumed, reference, "single device step 1 → cp=2 x tp=2 (sequence parallel)", first=1)


def test_cp2_hsdp_matches_single_device_and_resumes_on_it(reference, tmp_path):
    """HSDP shards the weights over dp_shard × cp (FSDP's strided layout in the checkpoint)."""
    check(launch(run, 4, dict(cp=2, dp_replicate=2), (0, STEPS), None, str(tmp_path), 2), reference,
          "cp=2 x dp_replicate=2")
    check([run(None, (2, STEPS), str(tmp_path))], reference, "cp=2 x dp_replicate=2 step 2 → single device", first=2)


def test_cp2_ep2_fsdp_matches_single_device(reference):
    """EP borrows its ranks from dp_shard × cp: here the ep group is the cp ranks, the all-to-all carries both cp
    ranks' tokens, experts FSDP-sharded over dp_shard (their gradients divided by dp · cp)."""
    check(launch(run, 4, dict(cp=2, dp_shard=2, ep=2)), reference, "cp=2 x dp_shard=2 x ep=2")


# Gradient accumulation over 2 steps, 4 layers (2 per pipeline stage), a balance loss that moves the routers.
CP_PRETRAIN = ("--set", "aux_loss_coeff=0.01", "--set", "log_interval=1", "--grad-accum", "2",
               "--set", "model.num_hidden_layers=4")


@pytest.fixture(scope="module")
def single_pretrain(tmp_path_factory):
    from test_pretrain_cli import pretrain_args

    from seekforge.cli import main

    root = tmp_path_factory.mktemp("pretrain_single")
    main(pretrain_args(root, *CP_PRETRAIN))
    return root


@pytest.mark.parametrize("world, layout", [(2, "cp=2"), (4, "cp=2,pp=2,microbatches=2")])
def test_pretrain_with_cp_matches_single_device(world, layout, single_pretrain, tmp_path, capfd):
    """`seekforge pretrain --parallel cp=2` (and with a pipeline) trains the single device's curve (balance loss
    and aux-loss-free bias on: the expert loads are summed over the cp ranks); rank 0 alone logs, once a step."""
    from test_pretrain_cli import LOSS_TOL, assert_same_curves, curves, pretrain_args, run_cli
    from test_pretrain_cli import STEPS as PRETRAIN_STEPS

    from seekforge.model.hf import load_hf

    capfd.readouterr()
    launch(run_cli, world, pretrain_args(tmp_path, *CP_PRETRAIN, "--parallel", layout))
    out = capfd.readouterr().out
    assert out.count(f"parallel: {world} ranks (gloo), cp=2") == 1 and out.count("done:") == 1
    assert all(out.count(f"step {s:>5}/{PRETRAIN_STEPS}") == 1 for s in range(1, PRETRAIN_STEPS + 1)), out
    single, got = curves(single_pretrain), curves(tmp_path)
    assert sorted(got) == list(range(1, PRETRAIN_STEPS + 1))
    assert_same_curves(got, single, range(1, PRETRAIN_STEPS + 1))
    assert got[1]["tokens_per_s"] * got[1]["step_time_s"] == pytest.approx(2 * 4 * 32)  # the global batch's tokens
    ref, trained = load_hf(single_pretrain / "hf").state_dict(), load_hf(tmp_path / "hf").state_dict()
    worst = max((trained[k] - ref[k]).abs().max().item() for k in ref)
    assert single[PRETRAIN_STEPS]["aux_loss"] > 1e-3  # the balance loss is on
    diffs = {k: max(abs(got[s][k] - single[s][k]) for s in got) for k in ("loss", "mtp_loss", "aux_loss", "grad_norm")}
    diffs["eval_loss"] = abs(got[PRETRAIN_STEPS]["eval_loss"] - single[PRETRAIN_STEPS]["eval_loss"])
    assert diffs["eval_loss"] <= LOSS_TOL and diffs["aux_loss"] <= LOSS_TOL
    print(f"pretrain {layout}: max |diff| {', '.join(f'{k} {v:.1e}' for k, v in diffs.items())}, weights {worst:.1e}")
    assert worst <= WEIGHT_TOL
