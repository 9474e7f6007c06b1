"""GRPO's rollout step: G completions of each of the step's prompts, sampled on serve's LLMEngine in
the trainer's process.

The engine holds the very `Transformer` the optimizer updates where it can, so its weights are the
policy's tensors: no copy, no file (otherwise a replica refreshed in place, rl/replica.py). After each
update the prefix cache must go (its latents were computed with the old weights). Continuous batching
runs all prompts × G completions of a step together, finished sequences leaving the batch, so a step
costs about what its longest completion costs, not P·G generate calls.

Memory swap (vLLM's sleep mode, the seeds' heterogeneous swap): the engine's paged KV pool is only
needed while generating. `sleep()` frees it for the training phase, `wake_up()` allocates it again;
`offload` moves a reference model or optimizer state off the compute device while idle (a no-op on
CPU, where they already live in host memory).
"""

from __future__ import annotations

import torch

from seekforge.config import EngineConfig
from seekforge.rl.collectives import my_groups
from seekforge.rl.config import GRPOConfig
from seekforge.rl.data import render_prompt
from seekforge.serve.engine import LLMEngine
from seekforge.serve.kv_cache import zeros_on_demand
from seekforge.serve.sequence import SamplingParams


class Rollout:
    def __init__(self, policy, tokenizer, engine_config: EngineConfig):
        self.engine = LLMEngine(policy, tokenizer, engine_config)
        self.policy = policy
        self.tokenizer = tokenizer
        self._pool_shapes = [(c.c_kv.shape, c.k_pe.shape) for c in self.engine.runner.caches]
        self.asleep = False

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                 seeds: list[int] | None = None) -> list[list[int]]:
        """Token-id prompts → their completions' token ids (a stop token, when hit, included), prompt-
        major: prompt i's n completions at [i·n, (i+1)·n). seeds[i] seeds prompt i's completions (the
        j-th draws from seed + j), so results depend neither on batching nor on the global RNG."""
        if self.asleep:
            self.wake_up()
        training = self.policy.training
        self.policy.eval()
        engine = self.engine
        ids = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature,
                                    seed=None if seeds is None else seeds[i])
            ids.append(engine.add(engine.make_request(prompt, params, final_only=True)))
        done = {}
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        self.policy.train(training)
        return [list(c.token_ids) for i in ids for c in done[i].outputs]

    def weights_updated(self) -> None:
        """The policy's tensors changed in place: drop every cached latent computed with the old ones."""
        self.engine.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the KV pool (its contents are disposable between steps: no request runs)."""
        assert not self.engine.has_unfinished(), "sleep() with requests running"
        self.engine.reset_prefix_cache()
        for cache in self.engine.runner.caches:
            cache.c_kv = cache.c_kv.new_empty(0)
            cache.k_pe = cache.k_pe.new_empty(0)
        self.engine.runner.scratch.clear()
        self.asleep = True

    def wake_up(self) -> None:
        for cache, (c_kv_shape, k_pe_shape) in zip(self.engine.runner.caches, self._pool_shapes, strict=True):
            cache.c_kv = zeros_on_demand(c_kv_shape, cache.c_kv.dtype, cache.c_kv.device)
            cache.k_pe = zeros_on_demand(k_pe_shape, cache.k_pe.dtype, cache.k_pe.device)
        self.asleep = False


def engine_config(cfg: GRPOConfig) -> EngineConfig:
    """The trainer's engine: room for a whole step's completions in one continuous batch."""
    return EngineConfig(block_size=16, kv_cache_memory=cfg.kv_cache_memory,
                        max_num_seqs=max(cfg.prompts_per_step * cfg.group_size, 1), max_num_batched_tokens=4096,
                        compile=cfg.compile)


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Pretraining documents follow an end-of-document token (data/dataset joins documents with it),
    so a prompt starts after one, as every question the base model saw did. A chat prompt (a list of
    messages) is rendered by the tokenizer's chat template first (rl/data.render_prompt)."""
    return [tokenizer.eos_token_id, *tokenizer.encode(render_prompt(tokenizer, prompt))]


def rollout_seeds(seed: int, step: int, count: int, group_size: int) -> list[int]:
    """Disjoint per (step, prompt) streams; completion j of prompt i draws from seeds[i] + j."""
    return [(seed * 1_000_003 + step * 10_007 + i) * group_size for i in range(count)]


def sample_groups(rollout: Rollout, prompt_ids: list[list[int]], seeds: list[int], cfg: GRPOConfig
                  ) -> tuple[list[int], list[list[int]]]:
    """The step's rollout on this rank: its balanced share of the prompts (before generating, a prompt's
    expected work is its prompt tokens plus the completion budget) × G completions each.
    → (this rank's prompt indices, their completions' token ids, prompt-major)."""
    G = cfg.group_size
    mine = my_groups([G * (len(p) + cfg.max_new_tokens) for p in prompt_ids])
    completions = rollout.generate([prompt_ids[i] for i in mine], G, cfg.max_new_tokens, cfg.temperature,
                                   [seeds[i] for i in mine])
    return mine, completions


def offload(module_or_optimizer, device: torch.device | str) -> None:
    """Move a module's weights or an optimizer's state tensors to `device` in place."""
    if isinstance(module_or_optimizer, torch.nn.Module):
        module_or_optimizer.to(device)
        return
    for state in module_or_optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":  # fused AdamW keeps `step` where params are
                state[key] = value.to(device, non_blocking=True)
