"""Shared pieces of the layout-equivalence tests: the data, the single-device reference run, and
the same run under a ParallelConfig on every rank (called through dist_launcher.launch).

Every layout must reproduce the reference: same tiny model (seed 0), same global batch per step,
AdamW. Data-parallel ranks take equal slices of the global batch, so the mean of their losses is
the reference's loss and their averaged gradients are its gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from seekforge.config import ParallelConfig, preset
from seekforge.model.loss import lm_loss
from seekforge.model.model import build_model
from seekforge.parallel.mesh import build_mesh
from seekforge.parallel.parallelize import parallelize
from seekforge.parallel.tp import loss_context

STEPS, BATCH, SEQ = 3, 4, 16


def model_config(**overrides):
    return preset("tiny", **overrides)


def batches(cfg, steps: int = STEPS, batch: int = BATCH, seq: int = SEQ, seed: int = 0):
    """(steps, batch, seq) input ids and their next-token labels."""
    tokens = torch.randint(0, cfg.vocab_size, (steps, batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[..., :-1], tokens[..., 1:]


def make_optimizer(params):
    """AdamW with eps 1e-6: its step lr·m/(sqrt(v) + eps) turns fp32 reduction-order noise (~1e-9) in a
    near-zero gradient element into a weight difference of up to lr·noise/eps. At the default eps 1e-8 that is
    ~1e-5 of noise after 3 steps (measured 1.3e-5 under cp=2 with gradients equal to 4.5e-8); at 1e-6 it is
    ~1e-7, so the weights, too, compare at 1e-5 and the test sees the layout's math, not the optimizer's."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def reference_run(cfg, steps: int = STEPS):
    """Single device: per-step losses and the final weights."""
    model = build_model(cfg, seed=0)
    opt = make_optimizer(model.parameters())
    inputs, labels = batches(cfg, steps)
    losses = []
    for s in range(steps):
        loss, _ = lm_loss(model, inputs[s], labels[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_layout(cfg_overrides: dict, pc_kwargs: dict, steps: tuple[int, int] = (0, STEPS),
               load: str | None = None, save: str | None = None, auto: bool = False):
    """On each rank: build, parallelize (or pipeline), optionally resume from `load`, train steps
    [start, stop) of the shared data, optionally save to (and load from) the checkpoint root `save`
    (`load`) through train/checkpoint.py. Returns a dict with the dp-averaged
    `losses`, the full `weights` and flattened full `optim` state (at the end), and `loaded_weights` /
    `loaded_optim` right after loading. auto=True builds the same layout through AutoParallel."""
    from seekforge.parallel.pp import PipelineRunner
    from seekforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    cfg = model_config(**cfg_overrides)
    pc = ParallelConfig(**pc_kwargs)
    model = build_model(cfg, seed=0)
    if auto:
        from seekforge.parallel.auto import AutoParallel

        layout = AutoParallel(model).hsdp(pc.dp_replicate, pc.dp_shard).tp(pc.tp).ep(pc.ep).recompute(pc.recompute)
        if pc.pp > 1:
            runner = layout.pipeline(pc.pp_schedule, pc.microbatches, pp=pc.pp)
            modules = runner.modules
        else:
            modules = [layout.build()]
        mesh = layout.mesh
    elif pc.pp > 1:
        mesh = build_mesh(pc, cfg)
        runner = PipelineRunner(model, pc, mesh)
        modules = runner.modules
    else:
        mesh = build_mesh(pc, cfg)
        modules = [parallelize(model, pc, mesh)]
    optimizers = [make_optimizer(m.parameters()) for m in modules]  # one per stage: checkpoint names stay per module
    out = {}
    if load is not None:
        load_checkpoint(latest_checkpoint(load), modules, optimizers)
        out["loaded_weights"], out["loaded_optim"] = full_state(modules, optimizers)
    dp_mesh = mesh["dp"]
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    inputs, labels = batches(cfg, steps[1])
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses = []
    for s in range(*steps):
        if pc.pp > 1:
            parts = runner.step(inputs[s, rows], labels[s, rows])
            runner.sync_tied_embedding_grads()
            loss = parts["loss"].clone() if parts else torch.zeros(())  # only last-stage ranks hold one
        else:
            with loss_context(mesh["tp"]):
                loss, _ = lm_loss(model, inputs[s, rows], labels[s, rows])
                loss.backward()
            loss = local_value(loss.detach()).clone()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        dist.all_reduce(loss)  # one contribution per dp rank (tp replicas averaged below)
        losses.append(loss.item() / dp / mesh["tp"].size())
    if save is not None:
        save_checkpoint(save, steps[1], modules, optimizers)
    out["losses"] = losses
    out["weights"], out["optim"] = full_state(modules, optimizers)
    return out


def full_state(modules, optimizers) -> tuple[dict, dict]:
    """Full weights and flattened full optimizer state of this rank's modules, as plain tensors."""
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    weights, optim = {}, {}
    for module, opt in zip(modules, optimizers, strict=True):
        m, o = get_state_dict(module, opt, options=options)
        weights.update({k: local_value(v).detach().clone() for k, v in m.items()})
        optim.update({k: local_value(v).detach().clone() if torch.is_tensor(v) else v for k, v in o.items()})
    return weights, optim


def merged(results, key: str) -> dict:
    """Union over ranks of a per-rank state dict (pipeline ranks each hold their own stages)."""
    out = {}
    for r in results:
        out.update(r[key])
    return out


def assert_matches_reference(results, reference, loss_tol: float, weight_tol: float):
    """Every rank's losses and rank 0's gathered weights match the single-device run."""
    ref_losses, ref_state = reference
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=0, atol=loss_tol)
    state = merged(results, "weights")
    assert set(state) == set(ref_state), set(state) ^ set(ref_state)
    worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst <= weight_tol, f"max |weight - reference| = {worst:.2e} > {weight_tol:.0e}"
    return worst


class OverlapRecord(list):
    """The order of an EP MoE layer's all-to-all starts and waits and its shared experts' forward and backward,
    filled while the layer runs (the shared experts must sit between a start and its wait: overlap); `stop`
    puts the all-to-all back as it was."""

    def __init__(self, moe):
        from seekforge.parallel import ep as ep_module

        super().__init__()
        self._flight = ep_module._InFlight
        self._originals = start, wait = self._flight.start, self._flight.wait
        self._flight.start = lambda flight, *a: (self.append("start"), start(flight, *a))[1]
        self._flight.wait = lambda flight: (self.append("wait"), wait(flight))[1]
        moe.shared_experts.register_forward_hook(lambda *_: self.append("shared"))
        moe.shared_experts.register_full_backward_hook(lambda *_: self.append("shared"))

    def stop(self) -> None:
        self._flight.start, self._flight.wait = self._originals


def resume_in_another_layout(tmp_path, saved: tuple[int, dict], resumed: tuple[int, dict], loss_tol: float,
                             weight_tol: float, steps: int = 3, save_at: int = 2) -> float:
    """Train `save_at` steps under saved = (world, ParallelConfig kwargs) and checkpoint, resume under `resumed`
    to `steps`: the loaded weights equal the saved ones exactly and the continued run matches the single-device
    reference. → the largest weight difference from it."""
    from dist_launcher import launch

    ref_losses, ref_state = reference_run(model_config(), steps=steps)
    ckpt = str(tmp_path / "checkpoints")
    before = launch(run_layout, saved[0], {}, saved[1], (0, save_at), None, ckpt)
    after = launch(run_layout, resumed[0], {}, resumed[1], (save_at, steps), ckpt, None)
    for k, v in before[0]["weights"].items():
        torch.testing.assert_close(after[0]["loaded_weights"][k], v, rtol=0, atol=0, msg=k)
    return assert_matches_reference(after, (ref_losses[save_at:], ref_state), loss_tol, weight_tol)
