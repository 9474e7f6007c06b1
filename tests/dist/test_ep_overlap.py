"""TrainConfig.overlap (parallel/overlap.py): gradient accumulation with each micro-batch's forward running
beside the previous one's backward gives bit-identical losses, grad norms and weights to the sequential loop,
under ep=2 (FSDP over dp_shard=2) on 2 gloo ranks, with and without full recompute."""

import pytest
import torch
import torch.distributed as dist
from dist_harness import BATCH, SEQ, batches, full_state, make_optimizer, model_config
from dist_launcher import launch

from seekforge.config import ParallelConfig, TrainConfig
from seekforge.model.model import build_model
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.train.trainer import Trainer

WORLD, STEPS, GRAD_ACCUM = 2, 3, 3


def train(overlap: bool, recompute: str, out_dir: str) -> dict:
    """STEPS optimizer steps of GRAD_ACCUM micro-batches through Trainer.train_step → losses, grad norms, weights."""
    cfg = model_config()
    pc = ParallelConfig(dp_shard=WORLD, ep=WORLD, recompute=recompute)
    mesh = build_mesh(pc, cfg)
    model = parallelize(build_model(cfg, seed=0), pc, mesh)
    inputs, labels = batches(cfg, STEPS * GRAD_ACCUM)
    rank = dist.get_rank()
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    loader = [{"input_ids": inputs[i, rows], "labels": labels[i, rows]} for i in range(STEPS * GRAD_ACCUM)]
    tc = TrainConfig(preset="tiny", dtype="fp32", seq_len=SEQ, micro_batch_size=BATCH, grad_accum=GRAD_ACCUM,
                     steps=STEPS, warmup=1, lr=1e-3, peak_flops=1e12, overlap=overlap, out_dir=out_dir)
    trainer = Trainer(tc, model, loader, mesh=mesh)
    history = [trainer.train_step() for _ in range(STEPS)]
    weights, _ = full_state([model], [make_optimizer(model.parameters())])
    return dict(losses=[m["loss"] for m in history], grad_norms=[m["grad_norm"] for m in history],
                weights=weights)


def run_rank(recompute: str, out_dir: str) -> dict:
    from seekforge.parallel import overlap

    sequential = train(False, recompute, out_dir)
    return dict(sequential=sequential, overlapped=train(True, recompute, out_dir), lanes=len(overlap._twins))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_overlap_matches_sequential_accumulation(tmp_path, recompute):
    for r in launch(run_rank, WORLD, recompute, str(tmp_path)):
        seq, ovl = r["sequential"], r["overlapped"]
        assert ovl["losses"] == seq["losses"], (ovl["losses"], seq["losses"])
        assert ovl["grad_norms"] == seq["grad_norms"], (ovl["grad_norms"], seq["grad_norms"])
        assert set(ovl["weights"]) == set(seq["weights"])
        for k, v in seq["weights"].items():
            torch.testing.assert_close(ovl["weights"][k], v, rtol=0, atol=0, msg=k)
        assert r["lanes"] == 1  # the ep group got its lane-1 twin: two micro-batches exchanged at once
