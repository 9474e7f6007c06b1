"""seekforge's GRPOTrainer.step() against TRL 1.16's GRPOTrainer.train(), end to end: the same fp32 weights
(a tiny seekforge DeepSeek-V3 and transformers' DeepseekV3ForCausalLM holding them), the same prompt and
completion tokens, the same rewards, μ optimizer steps of plain SGD on both sides (no warmup, no gradient
clipping), and every optimizer step's gradient compared: within 1e-4 relative (global L2) for every case, and
each case's option changes seekforge's gradients by far more than that (so the case tests the option).

TRL runs its own advantage, loss, micro-batching and optimizer code; only what would sample is replaced: its
`rollout_func` hook returns seekforge's completions, and its shuffle of the generation batch is the identity so
that its micro-batches are consecutive sequences (GRPOConfig.micro_batch_size). seekforge's rollout
(`sample_groups`) returns those same completions; its optimizer is swapped for SGD after construction.
The logged loss, entropy, KL and clip fraction of the last optimizer step are compared too (token means, as TRL
logs them; one micro-batch, where TRL's mean of micro-batch means is the token mean)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")

P, G, L = 2, 4, 6  # prompts, completions per prompt, max new tokens: 8 sequences
LR = 0.5  # large enough that the second step's ratios leave the clip range for a good share of the tokens
MODEL = dict(num_nextn_predict_layers=0, vocab_size=320, bos_token_id=256, eos_token_id=257)


def text_reward(prompt, completion, **meta):
    """Differs between almost any two completions, so every group has a gradient."""
    return sum(map(ord, completion)) % 7 / 7


def fixed_completions(eos: int, seed: int = 0) -> list[list[int]]:
    """Random lowercase letters, of mixed lengths whose two halves (bnpo's micro-batches) hold different numbers
    of tokens; they end on end-of-sequence, but for two of the L-long ones, cut at max_new_tokens
    (mask_truncated_completions drops those). A group's completions share their first letter: where the
    group's positive advantages outweigh its negative ones on it, the negative-advantage completions' first
    token gains probability (ratio > 1: what `delta` caps)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, truncated = [2, L, 4, L, 5, 3, L, 2], {1, 6}
    out = []
    for i, n in enumerate(lengths):
        ids = [97 + i // G, *torch.randint(97, 123, (n - 1,), generator=gen).tolist()]
        out.append(ids if i in truncated else ids[:-1] + [eos])
    return out


def tiny():
    from seekforge.config import preset
    from seekforge.model.model import build_model

    return build_model(preset("tiny", **MODEL), seed=0)


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of every step's gradients, by parameter name."""

    def __init__(self, named_parameters, lr: float):
        self.names = [name for name, _ in named_parameters]
        super().__init__([p for _, p in named_parameters], lr=lr)
        self.grads = []

    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.grads.append({n: p.grad.clone() for n, p in zip(self.names, params, strict=True) if p.grad is not None})
        return super().step(closure)


def run_seekforge(tmp_path, monkeypatch, options: dict):
    """One GRPOTrainer.step() (μ optimizer steps) → (per-step gradients, metrics, prompt ids, completions)."""
    import seekforge.rl.trainer as trainer_module
    from seekforge.model.tokenizer import load_tokenizer
    from seekforge.rl.config import GRPOConfig
    from seekforge.rl.trainer import GRPOTrainer

    options = {"lr": LR, **options}
    cfg = GRPOConfig(rewards=[f"{__name__}:text_reward"], steps=1, prompts_per_step=P, group_size=G, max_new_tokens=L,
                     clip_grad=0.0, eval_prompts=0, dtype="fp32", kv_cache_memory="4MiB", save_interval=0,
                     out_dir=str(tmp_path / "seekforge"), **options)
    tokenizer = load_tokenizer("byte")
    policy = tiny()
    trainer = GRPOTrainer(cfg, policy, tokenizer, copy.deepcopy(policy) if cfg.beta > 0 else None)
    trainer.optimizer = RecordingSGD([(n, p) for n, p in policy.named_parameters() if p.requires_grad], cfg.lr)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    completions = fixed_completions(tokenizer.eos_token_id)
    seen = {}

    def fixed_rollout(rollout, prompt_ids, seeds, cfg):
        seen["prompt_ids"] = [p for p in prompt_ids for _ in range(G)]
        return list(range(len(prompt_ids))), completions

    monkeypatch.setattr(trainer_module, "sample_groups", fixed_rollout)
    metrics = trainer.step()
    return trainer.optimizer.grads, metrics, seen["prompt_ids"], completions


def trl_config(tmp_path, options: dict):
    """GRPOConfig options → TRL's GRPOConfig: the same settings under TRL's names."""
    from trl import GRPOConfig

    opts = {key: value for key, value in options.items() if key not in SEEKFORGE_ONLY}
    mu = opts.pop("mu", 1)
    micro_batch = opts.pop("micro_batch_size", 0) or P * G
    renamed = {"clip_low": "epsilon", "clip_high": "epsilon_high", "lr": "learning_rate"}
    settings = dict(epsilon=0.2, epsilon_high=0.28, use_bias_correction_kl=False, learning_rate=LR)  # seekforge's
    settings.update({renamed.get(key, key): value for key, value in opts.items()})
    return GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=P * G // micro_batch, num_generations=G, max_completion_length=L,
        num_iterations=mu, max_steps=mu, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, optim="sgd", max_grad_norm=0.0, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, shuffle_dataset=False, seed=0,
        model_init_kwargs={"dtype": "float32"}, **settings)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """transformers' DeepseekV3ForCausalLM with the tiny seekforge model's weights, and the byte tokenizer: a
    directory TRL loads the policy (and its reference model) from."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from seekforge.model.tokenizer import load_tokenizer

    model = tiny()
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**model.cfg.to_hf()))
    state = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in model.state_dict().items()}
    result = hf.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    load_tokenizer("byte").save(path)
    return path


def run_trl(tmp_path, monkeypatch, checkpoint, options: dict, prompt_ids, completions):
    """TRL's GRPOTrainer.train() for μ optimizer steps → (per-step gradients by seekforge's names, its logs)."""
    import trl.trainer.grpo_trainer as grpo_trainer
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from seekforge.model.tokenizer import load_tokenizer

    decode = load_tokenizer("byte").decode
    grads = []

    class RecordGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n.removeprefix("model."): p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None})

    def rollout(prompts, trainer):
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    def reward(prompts, completions, completion_ids, **kwargs):
        return [text_reward(None, decode(ids)) for ids in completion_ids]

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    trainer = GRPOTrainer(model=str(checkpoint), reward_funcs=reward, args=trl_config(tmp_path, options),
                          train_dataset=Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(P)]}),
                          processing_class=AutoTokenizer.from_pretrained(checkpoint), callbacks=[RecordGradients()],
                          rollout_func=rollout)
    trainer.train()
    return grads, [log for log in trainer.state.log_history if "loss" in log]


def relative_difference(ours: dict, theirs: dict) -> float:
    """‖ours − theirs‖ / ‖theirs‖ over every parameter's gradient."""
    assert ours.keys() == theirs.keys()
    diff = sum(((ours[k] - theirs[k]) ** 2).sum() for k in theirs)
    return (diff / sum((g ** 2).sum() for g in theirs.values())).sqrt().item()


# Every option the issue names, each in a case with μ = 2 (the second step's gradient depends on the first
# update, so it checks the ratio and the update too). `off`: the same case with the option at its default.
CASES = {
    "temperature": dict(temperature=0.7, beta=0.04, mu=2),
    "kl_k3": dict(beta=0.1, mu=2),
    "kl_bias_corrected": dict(beta=0.1, mu=2, use_bias_correction_kl=True),
    "gspo": dict(importance_sampling_level="sequence", loss_type="grpo", beta=0.04, use_bias_correction_kl=True, mu=2),
    "scale_rewards_batch": dict(scale_rewards="batch", mu=2),
    "cispo": dict(loss_type="cispo", clip_high=1.5, mu=2),
    "sapo": dict(loss_type="sapo", beta=0.04, mu=2),
    "delta": dict(delta=1.5, loss_type="grpo", lr=1.0, mu=3),  # ratios of negative-advantage tokens pass 1.5
    "mask_truncated": dict(mask_truncated_completions=True, loss_type="grpo", mu=2),
    "top_entropy": dict(top_entropy_quantile=0.5, mu=2),
    "bnpo_two_micro_batches": dict(loss_type="bnpo", micro_batch_size=4, beta=0.04, mu=2),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04, scale_rewards="none", mu=3),
    # the matched configurations, kept matched: TRL's default KL on grpo, one sequence per packed row
    "grpo_one_sequence_per_row": dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=True, clip_low=0.1,
                                      clip_high=0.3, scale_rewards="none", max_pack_count=1, mu=2),
}
SEEKFORGE_ONLY = ("max_pack_count",)  # how rows are packed: no TRL counterpart, no effect on the gradient
OFF = {"temperature": dict(temperature=1.0), "kl_bias_corrected": dict(use_bias_correction_kl=False),
       "gspo": dict(importance_sampling_level="token"), "scale_rewards_batch": dict(scale_rewards="group"),
       "cispo": dict(loss_type="dapo", clip_high=0.28), "sapo": dict(loss_type="grpo"), "delta": dict(delta=None),
       "mask_truncated": dict(mask_truncated_completions=False), "top_entropy": dict(top_entropy_quantile=1.0),
       "bnpo_two_micro_batches": dict(micro_batch_size=0)}
FAST = ("temperature", "kl_bias_corrected")  # the default run's share; the others are marked slow


def check_case(name, tmp_path, monkeypatch, checkpoint):
    options = CASES[name]
    ours, metrics, prompt_ids, completions = run_seekforge(tmp_path, monkeypatch, options)
    theirs, logs = run_trl(tmp_path, monkeypatch, checkpoint, options, prompt_ids, completions)
    assert len(ours) == len(theirs) == options.get("mu", 1)
    differences = [relative_difference(a, b) for a, b in zip(ours, theirs, strict=True)]
    print(f"{name}: relative gradient difference per optimizer step {[f'{d:.1e}' for d in differences]}")
    assert max(differences) <= 1e-4, differences
    if name in OFF:  # the option matters: without it, seekforge's gradients are far from TRL's
        without, *_ = run_seekforge(tmp_path, monkeypatch, {**options, **OFF[name]})
        away = max(relative_difference(a, b) for a, b in zip(without, theirs, strict=True))
        print(f"{name}: without the option, {away:.1e}")
        assert away > 1e-2
    if not options.get("micro_batch_size"):  # one micro-batch: TRL logs the token means seekforge logs
        last = logs[-1]
        expected = {"loss": last["loss"], "entropy": last["entropy"]}
        if options.get("beta"):
            expected["kl"] = last["kl"]
        if "clip_ratio/region_mean" in last and options.get("importance_sampling_level") != "sequence":
            expected["clip_fraction"] = last["clip_ratio/region_mean"]
        if "cispo_clip_ratio" in last:
            expected["clip_fraction"] = last["cispo_clip_ratio"]
            assert expected["clip_fraction"] > 0  # the cap binds
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("name", FAST)
def test_matches_trl(name, tmp_path, monkeypatch, hf_checkpoint):
    check_case(name, tmp_path, monkeypatch, hf_checkpoint)


@pytest.mark.slow  # ~2-4 s a case: a TRL trainer and two seekforge trainers each
@pytest.mark.parametrize("name", [name for name in CASES if name not in FAST])
def test_matches_trl_every_option(name, tmp_path, monkeypatch, hf_checkpoint):
    check_case(name, tmp_path, monkeypatch, hf_checkpoint)
