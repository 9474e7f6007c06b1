"""TrainConfig.overlap (parallel/overlap.py): gradient accumulation with each micro-batch's forward running
beside the previous one's backward gives bit-identical losses, grad norms and weights to the sequential loop,
under ep=2 (FSDP over dp_shard=2) on 2 gloo ranks, with and without full recompute, and with the hierarchical
(ep=4, ep_nodes=2) and expert-TP (etp=2 × ep=2) dispatchers on 4; and DualPipeV with its
overlapped forward/backward pairs run at once gives bit-identical losses and weights, on pp=2 and pp=2 × ep=2."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import BATCH, SEQ, batches, full_state, make_optimizer, model_config
from dist_launcher import launch
from torch.distributed.pipelining.schedules import OVERLAP_F_B

from seekforge.config import ParallelConfig, TrainConfig
from seekforge.model.model import build_model
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.train.trainer import Trainer

WORLD, STEPS, GRAD_ACCUM = 2, 3, 3


def train(overlap: bool, recompute: str, out_dir: str, layout: dict | None = None) -> dict:
    """STEPS optimizer steps of GRAD_ACCUM micro-batches through Trainer.train_step → losses, grad norms, weights."""
    cfg = model_config()
    pc = ParallelConfig(**(layout or dict(dp_shard=WORLD, ep=WORLD)), recompute=recompute)
    mesh = build_mesh(pc, cfg)
    model = parallelize(build_model(cfg, seed=0), pc, mesh)
    world = dist.get_world_size()
    inputs, labels = batches(cfg, STEPS * GRAD_ACCUM, batch=world)
    rank = dist.get_rank()
    rows = slice(rank, rank + 1)
    loader = [{"input_ids": inputs[i, rows], "labels": labels[i, rows]} for i in range(STEPS * GRAD_ACCUM)]
    tc = TrainConfig(preset="tiny", dtype="fp32", seq_len=SEQ, micro_batch_size=BATCH, grad_accum=GRAD_ACCUM,
                     steps=STEPS, warmup=1, lr=1e-3, peak_flops=1e12, overlap=overlap, out_dir=out_dir)
    trainer = Trainer(tc, model, loader, mesh=mesh)
    history = [trainer.train_step() for _ in range(STEPS)]
    weights, _ = full_state([model], [make_optimizer(model.parameters())])
    return dict(losses=[m["loss"] for m in history], grad_norms=[m["grad_norm"] for m in history],
                weights=weights)


def run_rank(recompute: str, out_dir: str, layout: dict | None = None) -> dict:
    from seekforge.parallel import overlap

    sequential = train(False, recompute, out_dir, layout)
    return dict(sequential=sequential, overlapped=train(True, recompute, out_dir, layout), lanes=len(overlap._twins))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_overlap_matches_sequential_accumulation(tmp_path, recompute):
    check_identical(launch(run_rank, WORLD, recompute, str(tmp_path)), lanes=1)


@pytest.mark.parametrize("layout,lanes", [(dict(dp_shard=4, ep=4, ep_nodes=2), 2), (dict(dp_shard=4, ep=2, etp=2), 2)],
                         ids=["ep4_nodes2", "etp2xep2"])
def test_overlap_with_hierarchical_and_expert_tp_dispatch(tmp_path, layout, lanes):
    """The hierarchical dispatcher's rail and node groups, and expert-TP's etp group, get their lanes too."""
    check_identical(launch(run_rank, 4, "none", str(tmp_path), layout), lanes)


def check_identical(results, lanes: int) -> None:
    for r in results:
        seq, ovl = r["sequential"], r["overlapped"]
        assert ovl["losses"] == seq["losses"], (ovl["losses"], seq["losses"])
        assert ovl["grad_norms"] == seq["grad_norms"], (ovl["grad_norms"], seq["grad_norms"])
        assert set(ovl["weights"]) == set(seq["weights"])
        for k, v in seq["weights"].items():
            torch.testing.assert_close(ovl["weights"][k], v, rtol=0, atol=0, msg=k)
        assert r["lanes"] == lanes  # each expert group got its lane-1 twin: two micro-batches exchanged at once


def pipeline(overlap: bool, layout: dict) -> dict:
    """3 steps of a DualPipeV pipeline (4 layers, 4 micro-batches) → losses and weights of this rank's stages."""
    from seekforge.parallel.pp import PipelineRunner

    cfg = model_config(num_hidden_layers=4)
    pc = ParallelConfig(pp=2, pp_schedule="DualPipeV", microbatches=4, **layout)
    mesh = build_mesh(pc, cfg)
    runner = PipelineRunner(build_model(cfg, seed=0), pc, mesh)
    if overlap:
        runner.overlap_f_b()
    optimizers = [make_optimizer(m.parameters()) for m in runner.modules]
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    inputs, labels = batches(cfg, STEPS, batch=4 * dp)  # 4 rows per rank: one per micro-batch
    rows = slice(dp_rank * 4, (dp_rank + 1) * 4)
    losses = []
    for s in range(STEPS):
        parts = runner.step(inputs[s, rows], labels[s, rows])
        runner.sync_tied_embedding_grads()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(parts["loss"].item() if parts else None)
    weights, _ = full_state(runner.modules, optimizers)
    order = runner.schedule.pipeline_order_with_comms[runner.schedule.rank]
    pairs = sum(a.computation_type == OVERLAP_F_B for a in order)
    return dict(losses=losses, weights=weights, pairs=pairs,
                registered=OVERLAP_F_B in runner.schedule._comp_type_to_function_map)


def pipeline_rank(layout: dict) -> dict:
    return dict(sequential=pipeline(False, layout), overlapped=pipeline(True, layout))


@pytest.mark.parametrize("world,layout", [(2, {}), (4, dict(dp_shard=2, ep=2))], ids=["pp2", "pp2xep2"])
def test_dualpipev_overlap_matches_sequential(world, layout):
    for r in launch(pipeline_rank, world, layout):
        seq, ovl = r["sequential"], r["overlapped"]
        assert ovl["losses"] == seq["losses"], (ovl["losses"], seq["losses"])
        for k, v in seq["weights"].items():
            torch.testing.assert_close(ovl["weights"][k], v, rtol=0, atol=0, msg=k)
        assert ovl["pairs"] > 0 and ovl["registered"] and not seq["registered"]  # the pairs ran at once
