"""The training step's GPU path (model/gpu), run on CPU tensors inside `forced_gpu_path()`: a whole optimizer
step of a DeepSeek-V3-shaped model (routed + shared experts, group-limited routing, MTP, the sequence balance
loss, the aux-loss-free bias update, AdamW, the clip) without one host sync, the same loss as the CPU path's,
and the trainer reading the deferred metrics on logging steps only."""

import json

import pytest
import torch

from seekforge.model.gpu import forced_gpu_path, triton_ready
from seekforge.model.gpu.sync import HostSyncGuard
from seekforge.model.model import build_model
from seekforge.model.precision import cpu_has_native_bf16
from seekforge.train.trainer import Trainer

from .conftest import PatternDataset, tiny_train_config

pytestmark = pytest.mark.skipif(not triton_ready(torch.device("cpu")), reason="needs triton (interpreted on CPU)")

# Ops one GPU-path step dispatches here (measured + ~20%), views and the Triton interpreter's copies included:
# a step that starts looping or syncing again (a per-expert loop, a cache-sized loss chunk) blows through it.
MAX_OPS = {"fp32": 4700, "bf16": 5200}


class Batches:
    """The same few batches in turn: a loader with no host reads of its own (StandInLoader's .tolist() would
    count as a sync in the guard), with the state methods the Trainer expects."""

    def __init__(self, cfg, count: int = 4):
        data = PatternDataset(cfg.model_config().vocab_size, cfg.seq_len, cfg.micro_batch_size * count)
        tokens = data.tokens.view(count, cfg.micro_batch_size, -1)
        self.batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        return batch

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _trainer(tmp_path, dtype: str, **overrides) -> Trainer:
    cfg = tiny_train_config(tmp_path, dtype=dtype, aux_loss_coeff=1e-2, bias_update_speed=1e-2, **overrides)
    model_cfg = cfg.model_config()
    assert model_cfg.n_shared_experts and model_cfg.n_group > 1 and model_cfg.num_nextn_predict_layers
    return Trainer(cfg, build_model(model_cfg, seed=0), Batches(cfg))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_path_step_has_no_host_sync_and_the_cpu_paths_loss(tmp_path, dtype):
    if dtype == "bf16" and not cpu_has_native_bf16():
        pytest.skip("bf16 autocast is emulated (slow) on this CPU")
    cpu = _trainer(tmp_path / "cpu", dtype)
    gpu = _trainer(tmp_path / "gpu", dtype)
    cpu_steps = [cpu.train_step() for _ in range(2)]
    with forced_gpu_path():
        warm = gpu.train_step()  # AdamW's states, the kernels' first launches
        with HostSyncGuard(strict=True) as guard:
            step = gpu.train_step()
    print(f"GPU-path train step ({dtype}): {guard.summary(12)}")
    assert guard.ops < MAX_OPS[dtype], guard.summary(40)
    assert isinstance(step["loss"], torch.Tensor)  # still on the device: read on a logging step
    gpu_steps = gpu.read_metrics([warm], 1.0) + gpu.read_metrics([step], 1.0)
    tol = 1e-4 if dtype == "fp32" else 2e-2
    for c, g in zip(cpu_steps, gpu_steps, strict=True):
        assert list(g) == list(c)  # the same records, keys in the same order
        for name in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
            assert g[name] == pytest.approx(c[name], rel=tol), name
    if dtype == "fp32":  # the same routing (bf16's other roundings, in attention first, may flip a token's pick)
        assert [s["expert_imbalance"] for s in gpu_steps] == [s["expert_imbalance"] for s in cpu_steps]
        for moe_cpu, moe_gpu in zip(cpu.moe_layers, gpu.moe_layers, strict=True):  # so the same bias updates
            torch.testing.assert_close(moe_gpu.gate.e_score_correction_bias, moe_cpu.gate.e_score_correction_bias)


def test_fit_on_the_gpu_path_reads_metrics_on_logging_steps_only(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "fp32", steps=10, log_interval=2)
    reads = []
    read = trainer.read_metrics
    monkeypatch.setattr(trainer, "read_metrics", lambda records, seconds: reads.append(len(records)) or
                        read(records, seconds))
    with forced_gpu_path():
        history = trainer.fit(stop_at=5)
    assert reads == [2, 2, 1]  # steps 2 and 4 log a line; 5 ends the call
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    assert all(isinstance(r["loss"], float) and isinstance(r["expert_imbalance"], list) for r in lines)
    assert [r["loss"] for r in lines] == [h["loss"] for h in history]


@pytest.mark.slow
def test_compiled_blocks_on_the_gpu_path(tmp_path):
    """TrainConfig.compile (each block torch.compile'd: parallel/parallelize.compile_blocks) over the GPU path's
    code: the eager loss, and in bf16 (the GPU's training dtype: torch._grouped_mm traces there) whole-block
    graphs, without a graph break."""
    from torch._dynamo.utils import counters

    from seekforge.train.trainer import prepare_model

    dtype = "bf16" if cpu_has_native_bf16() else "fp32"
    torch._dynamo.reset()
    counters.clear()
    losses = {}
    for compile_ in (False, True):
        cfg = tiny_train_config(tmp_path / str(compile_), dtype=dtype, compile=compile_, grad_accum=1,
                                aux_loss_coeff=1e-2)
        trainer = Trainer(cfg, prepare_model(build_model(cfg.model_config(), seed=0), cfg), Batches(cfg))
        with forced_gpu_path():
            steps = [trainer.train_step() for _ in range(2)]
        losses[compile_] = [m["loss"] for m in trainer.read_metrics(steps, 1.0)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4 if dtype == "fp32" else 2e-2)
    if dtype == "bf16":
        assert not counters["graph_break"], dict(counters["graph_break"])
