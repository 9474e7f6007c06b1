"""The GRPO loop: after an update the co-located engine serves the new weights (its greedy outputs equal
a fresh engine's on a copy of the updated policy) with no file written; the KV pool sleeps during
training; a resumed run continues the uninterrupted run's curves exactly; μ > 1 and β > 0 run."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from seekforge.config import EngineConfig
from seekforge.model.tokenizer import load_tokenizer
from seekforge.rl.config import GRPOConfig
from seekforge.rl.trainer import GRPOTrainer, encode_prompt
from seekforge.serve.engine import LLMEngine
from seekforge.serve.sequence import SamplingParams
from tests.rl.conftest import tiny_model


def digit_reward(prompt, completion, **meta):
    """A signal an untrained model's samples differ in: the share of digits."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def varied_reward(prompt, completion, **meta):
    """Differs between almost any two completions, so every group has a gradient."""
    return sum(map(ord, completion)) % 7 / 7


def small_config(tmp_path, **overrides):
    """tmp_path None: the caller gives out_dir."""
    base = dict(rewards=[f"{__name__}:digit_reward"], steps=4, prompts_per_step=3, group_size=4, max_new_tokens=6,
                lr=3e-3, eval_prompts=8, eval_interval=2, save_interval=2, kv_cache_memory="4MiB", dtype="fp32",
                out_dir=str(tmp_path / "run") if tmp_path else "")
    base.update(overrides)
    return GRPOConfig(**base)


def make_trainer(cfg):
    policy = tiny_model()
    reference = copy.deepcopy(policy) if cfg.beta > 0 else None
    return GRPOTrainer(cfg, policy, load_tokenizer("byte"), reference)


def greedy(engine, prompts):
    outs = []
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, temperature=0.0), request_id=str(len(outs)))
        outs.append(None)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
    return [done[i] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_serves_updated_weights_without_files(tmp_path, monkeypatch, dtype):
    """fp32: the engine runs on the policy's own tensors. bf16 (bf16 training over fp32 master
    weights): the engine runs on a bf16 replica that each update refreshes in place."""
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(small_config(tmp_path, swap=True, dtype=dtype))
    assert (trainer.engine_model is trainer.policy) == (dtype == "fp32")
    tok = trainer.tokenizer
    prompts = [encode_prompt(tok, p) for p, _ in trainer.prompt_stream.eval_set[:4]]
    greedy(trainer.rollout.engine, prompts)  # fills the prefix cache with the old weights' latents
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    trainer.rollout.sleep()
    trainer.step()
    assert trainer.rollout.asleep  # the KV pool was freed for the training phase
    assert all(c.c_kv.numel() == 0 for c in trainer.rollout.engine.runner.caches)
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())
    assert sorted(os.listdir(tmp_path)) == []  # no file written during the iteration
    trainer.rollout.wake_up()
    engine_model = trainer.engine_model  # routing and RoPE frequencies stay fp32 in a replica too
    assert all(moe.gate.weight.dtype == torch.float32 for moe in engine_model.moe_layers())
    assert engine_model.rotary.inv_freq.dtype == torch.float32
    replica = copy.deepcopy(trainer.policy).cast(trainer.compute_dtype)
    fresh = LLMEngine(replica, tok, EngineConfig(kv_cache_memory="4MiB"))
    assert greedy(trainer.rollout.engine, prompts) == greedy(fresh, prompts)


def test_bf16_training_pass_equals_autocast_and_shares_the_engine_replica(tmp_path, monkeypatch):
    """bf16 GRPO trains on bf16 copies of the fp32 master weights (train/master.py) whose storage is the
    engine's replica: the gradients of a rollout batch equal autocast's over the masters bit for bit, on
    the first update and on a second one after the optimizer step (μ = 2: the copies are refreshed)."""
    import seekforge.rl.trainer as trainer_module

    calls = []
    accumulate = trainer_module.accumulate_gradients
    monkeypatch.setattr(trainer_module, "accumulate_gradients", lambda *a: calls.append(a) or accumulate(*a))
    trainer = make_trainer(small_config(tmp_path, dtype="bf16", mu=2, rewards=[f"{__name__}:varied_reward"]))
    replica = {p.data_ptr() for p in trainer.engine_model.parameters()}
    assert trainer.master_weights.params and all(c.data_ptr() in replica for c in trainer.master_weights.compute_copies)
    trainer.step()
    assert len(calls) == 2
    model, rows, batch, settings, compute_weights, masks = calls[-1]  # the second update's pass
    grads = []
    for weights in (compute_weights, None):
        model.zero_grad(set_to_none=True)
        with trainer._autocast():
            if weights is None:
                accumulate(model, rows, batch, settings)
            else:
                accumulate(model, rows, batch, settings, weights)
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*grads, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_resume_continues_the_uninterrupted_run(tmp_path):
    cfg = small_config(tmp_path, mu=2, beta=0.05, loss_type="grpo")
    full = make_trainer(cfg).fit(progress=False)
    assert all(m["kl"] >= 0 for m in full) and full[-1]["kl"] > 0

    cfg2 = small_config(tmp_path, mu=2, beta=0.05, loss_type="grpo", out_dir=str(tmp_path / "split"))
    first = make_trainer(cfg2).fit(stop_at=2, progress=False)
    resumed = make_trainer(cfg2)  # a new process would build everything fresh, then load
    assert resumed.resume()
    assert resumed.step_count == 2
    second = resumed.fit(progress=False)
    keys = ["reward_mean", "loss", "kl", "clip_fraction", "response_length", "eval_accuracy"]
    for a, b in zip(full, first + second, strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


def test_bad_config_fails_with_one_message():
    for overrides, match in [(dict(group_size=1), "group_size=1"), (dict(clip_low=-0.1), "clip_low=-0.1"),
                             (dict(rewards=["nope"]), "unknown reward 'nope'"),
                             (dict(loss_type="ppo"), "loss_type='ppo'"),
                             (dict(scale_rewards="global"), "scale_rewards='global'"),
                             (dict(loss_type="cispo"), "clip_high=0.28: cispo caps the ratio itself"),
                             (dict(delta=0.9), "delta=0.9"), (dict(importance_sampling_level="seq"), "'seq'"),
                             (dict(top_entropy_quantile=1.5), "top_entropy_quantile=1.5"),
                             (dict(micro_batch_size=5, prompts_per_step=2, group_size=4), "must divide the step's 8")]:
        with pytest.raises(ValueError, match=match):
            GRPOConfig(**overrides)


def test_scale_rewards_takes_trl_bools():
    """TRL's scale_rewards takes true / false as well as its names; so do this field's files and flags."""
    from seekforge.rl.config import load_grpo_config

    assert [GRPOConfig(scale_rewards=v).scale_rewards for v in (True, False, "batch")] == ["group", "none", "batch"]
    assert load_grpo_config(None, ["scale_rewards=false"]).scale_rewards == "none"
    with pytest.raises(ValueError, match="GRPOConfig.temperature='hot': expected a number"):
        load_grpo_config(None, ["temperature=hot"])


def _two_rank_run(out_dir: str, fsdp: bool, options: dict):
    import torch.distributed as dist

    from seekforge.model.dtensor import plain_tensor

    cfg = small_config(None, out_dir=out_dir, steps=2, eval_interval=1, save_interval=2, beta=0.05, fsdp=fsdp,
                       **options)
    trainer = make_trainer(cfg)
    history = trainer.fit(progress=False)
    weights = {k: plain_tensor(v).clone() for k, v in trainer.policy.state_dict().items()}
    engine = {k: v.clone() for k, v in trainer.engine_model.state_dict().items()}
    return history, weights if dist.get_rank() == 0 else None, engine


# micro-batches that span both ranks' groups (bnpo's normalization, the high-entropy threshold), truncated
# completions masked out, one ratio per sequence, the sampling temperature in the log-probs
LOSS_OPTIONS = dict(loss_type="bnpo", micro_batch_size=6, top_entropy_quantile=0.5, mask_truncated_completions=True,
                    importance_sampling_level="sequence", temperature=0.8, mu=2)


@pytest.mark.slow  # ~20 s each: two spawned ranks, two full iterations each
@pytest.mark.parametrize("fsdp, options", [(True, {}), (False, {}), (True, LOSS_OPTIONS)],
                         ids=["fsdp", "replicated", "fsdp-loss-options"])
def test_two_gloo_ranks_match_one_process(tmp_path, fsdp, options):
    """Each rank rolls out its balanced share of the prompts on its own engine; groups, rewards and
    advantages are whole; the summed gradients reproduce the one-process run, with the policy and its
    optimizer state FSDP-sharded (the engines' replicas refreshed from the shards) or replicated."""
    from tests.dist.dist_launcher import launch

    single = make_trainer(small_config(None, out_dir=str(tmp_path / "one"), steps=2, eval_interval=1,
                                       save_interval=0, beta=0.05, **options))
    expected = single.fit(progress=False)
    results = launch(_two_rank_run, 2, str(tmp_path / "two"), fsdp, options)
    history, weights, _ = results[0]
    for a, b in zip(expected, history, strict=True):
        for key in ("reward_mean", "reward_std", "response_length", "eval_accuracy", "zero_std_groups"):
            assert a[key] == b[key], key
        for key in ("loss", "kl", "clip_fraction", "entropy"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), key
    for name, value in single.policy.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)
        for _, _, engine in results:  # every rank's engine generates with the updated weights
            torch.testing.assert_close(engine[name], value, rtol=0, atol=1e-5, msg=name)


def test_probe_monitors_the_training_pass_and_times_each_phase(tmp_path):
    """The probe (seekforge/probe) in the GRPO loop: the monitor records every step's training pass
    (norms, gradients, updates), and the phase timer sees every phase."""
    probe = tmp_path / "probe.yaml"
    probe.write_text("monitor: {modules: ['re:layers\\.\\d+'], interval: 1}\n")
    trainer = make_trainer(small_config(tmp_path, steps=2, eval_prompts=0, probe=str(probe),
                                        rewards=[f"{__name__}:varied_reward"]))
    trainer.fit(progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run/probe/monitor_rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        entry = row["modules"]["layers.1"]
        assert entry["activation_norm"] > 0 and entry["output_grad_norm"] > 0
        assert entry["weight_grad_norm"] > 0 and entry["update_ratio"] > 0
    phases = {s.labels["phase"] for m in trainer.probe.registry.collect() for s in m.samples if "phase" in s.labels}
    assert {"rollout", "rewards", "backward", "optimizer"} <= phases


def test_optimizer_config_warms_up_then_holds_the_lr():
    """GRPO's own optimizer config (no pretraining TrainConfig): AdamW with GRPO's betas, μ steps per iteration,
    the lr linear over the warmup and constant after it."""
    from seekforge.train.optim import build_optimizer

    cfg = GRPOConfig(lr=1e-3, warmup=2, steps=3, mu=2, weight_decay=0.01)
    optimizer, scheduler = build_optimizer(tiny_model(), cfg.optimizer_config())
    assert optimizer.defaults["betas"] == (0.9, 0.99) and optimizer.param_groups[0]["weight_decay"] == 0.01
    lrs = []
    for _ in range(cfg.steps * cfg.mu):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3], rel=1e-12)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_changes_memory_not_the_run(tmp_path, mode):
    """GRPOConfig.recompute (TRL's gradient_checkpointing): the same rollouts, losses and updated weights as without,
    the engine still generating from the updated policy."""
    runs = {}
    for recompute in ("none", mode):
        trainer = make_trainer(small_config(tmp_path / recompute, steps=2, mu=2, eval_prompts=0, recompute=recompute))
        runs[recompute] = (trainer.fit(progress=False), trainer.policy.state_dict())
    keys = ["reward_mean", "loss", "clip_fraction", "response_length", "grad_norm"]
    assert [{k: m[k] for k in keys} for m in runs[mode][0]] == [{k: m[k] for k in keys} for m in runs["none"][0]]
    assert runs[mode][1].keys() == runs["none"][1].keys()  # checkpoints keep the plain names
    for name, value in runs["none"][1].items():
        torch.testing.assert_close(runs[mode][1][name], value, rtol=0, atol=0)
