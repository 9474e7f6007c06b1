"""Single-sequence generation with a latent KV cache: the simple reference path that the serving
engine (serve/) is tested against, and the pretraining run's sample.

Also the `seekforge generate --model DIR_OR_PRESET --prompt ...` verb (add_arguments / run below)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import torch

from seekforge.errors import InvalidSetting
from seekforge.model.load import load_model, model_width
from seekforge.model.model import LatentCache, Transformer
from seekforge.model.precision import auto_dtype_help, resolve_dtype

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


def check_sampling(temperature: float, top_k: int | None, top_p: float, min_p: float = 0.0,
                   spell: Callable[[str], str] = str) -> None:
    """The sampling settings' ranges, the one check for the server's SamplingParams and `generate`'s
    flags: InvalidSetting names the setting (the server's 400 reports it as `param`); `spell` writes
    its name as the user gave it (a request field, a flag). top_k -1 is vLLM's spelling of off."""

    def bad(key, value, expected):
        raise InvalidSetting(key, f"{spell(key)}={value!r}: {expected}")

    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1):
        bad("top_k", top_k, "must be an integer >= 1, or 0 / -1 for off")
    # the comparisons below are written so that NaN fails them
    if not 0 <= temperature < math.inf:
        bad("temperature", temperature, "must be a finite number >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        bad("top_p", top_p, "must be in (0, 1]")
    if not 0 <= min_p <= 1:
        bad("min_p", min_p, "must be in [0, 1]")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) → next ids (B,). temperature 0 (below GREEDY_BELOW) is greedy; top-k then top-p
    (nucleus) filtering."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int = 32, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Prefill the prompt (naive MLA), then decode one token at a time (absorbed MLA over the cache).
    Returns only the new token ids (a stop token, if hit, included)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    check_sampling(temperature, top_k, top_p)
    cfg = model.cfg
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings={cfg.max_position_embeddings}; shorten one")
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    caches = [LatentCache(cfg, 1, total, dtype, device) for _ in model.layers]
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    ids = torch.tensor([prompt_ids], device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids, kv_caches=caches)[:, -1]
        next_id = sample_next(logits, temperature, top_k, top_p, generator)
        out.append(int(next_id))
        if out[-1] in stop_token_ids:
            break
        ids = next_id[:, None]
    return out


def add_arguments(p):
    p.add_argument("--model", default="tiny", help="preset name or HF-format checkpoint directory")
    p.add_argument("--prompt", default="Once upon a time", help="text to continue")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate, at most (an EOS stops sooner)")
    # the sampling settings, checked as the server checks a request's (check_sampling)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, >= 0; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
                   "probabilities reach p, in (0, 1]; 1.0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed of the draw, for repeatable sampling (None: a "
                   "fresh draw each run)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32", "bfloat16", "float32"], default="auto",
                   help=f"auto: {auto_dtype_help()}")


def run(args):
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}; give at least 1")
    check_sampling(args.temperature, args.top_k, args.top_p, spell=lambda key: "--" + key.replace("_", "-"))
    dtype, why = resolve_dtype(args.dtype, hidden_size=model_width(args.model))
    print(f"dtype: {why}", file=sys.stderr)  # stdout carries the text alone
    model, tok = load_model(args.model, dtype)
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    prompt_ids = tok.encode(text, add_bos=tok.add_bos_token)  # a BOS only if training put one there
    start = time.perf_counter()
    stop = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    new = generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   args.seed, stop)
    elapsed = time.perf_counter() - start
    print(text + tok.decode(new))
    print(f"\n[{len(new)} tokens in {elapsed:.2f}s, {len(new) / elapsed:.1f} tokens/s]")
