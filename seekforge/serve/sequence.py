"""A request's sampling parameters and the per-sequence state the engine moves around.

One request with `n` completions becomes `n` Sequences that share the prompt. A Sequence's state is
explicit: its tokens (prompt + output), how many of them have latents in the cache
(`num_computed_tokens`), the cache blocks that hold them (`block_table`) and the chained hashes of
its full blocks (`block_hashes`, for prefix caching).
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from seekforge.errors import InvalidSetting
from seekforge.model.generate import GREEDY_BELOW, check_sampling
from seekforge.serve.structured import StructuredOutput


@dataclass
class SamplingParams:
    """OpenAI/vLLM sampling parameters. temperature 0 (below GREEDY_BELOW) is greedy; top_k 0, top_p 1, min_p 0 are
    off."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # vLLM: None off; k >= 0: each prompt token's logprob and the top k
    structured: StructuredOutput | None = None  # a grammar the output must follow (structured.py)
    skip_special_tokens: bool = True  # vLLM: leave special tokens out of the text

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

        def bad(key, expected):
            raise InvalidSetting(key, f"{key}={getattr(self, key)!r}: {expected}")

        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p)
        if self.top_k is None or self.top_k < 0:  # vLLM spells "off" as -1
            self.top_k = 0
        if not integer(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not integer(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or null for the rest of the context)")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be in [0, max_tokens]")
        # the comparisons below are written so that NaN fails them
        if not 0 < self.repetition_penalty < math.inf:
            bad("repetition_penalty", "must be a finite number > 0 (1 is off)")
        if self.seed is not None and (not integer(self.seed) or not -(2**63) <= self.seed < 2**63):
            bad("seed", "must be an integer that fits 64 bits")
        for key in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, key) <= 2:
                bad(key, "must be in [-2, 2]")
        for key in ("logprobs", "prompt_logprobs"):
            if getattr(self, key) is not None and not 0 <= getattr(self, key) <= 20:
                bad(key, "must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        """temperature 0, or one so small that it is greedy in effect (below 1e-5, as in vLLM): dividing the logits
        by 1e-38 overflows fp32, and the draw then reads NaNs."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, eos_token_id: int | None, cache_salt: str | None = None, lora=None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.max_tokens = max_tokens  # resolved: params.max_tokens or the rest of the context
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose latents are in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks, in order
        self.cache_salt = cache_salt
        self.lora = lora  # a serve.lora.LoRAAdapter, or None for the base model
        self.stop_token_ids = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            self.stop_token_ids.add(eos_token_id)
        # Each completion of a seeded request gets its own stream, so results do not depend on batching.
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)
        # Speculative decoding (spec_decode.py): tokens the MTP modules proposed after the last one, not
        # yet verified, and per draft the distribution it was drawn from (d, V) (None for greedy).
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.matcher = None  # with params.structured: this sequence's llguidance matcher (set by the engine)
        self.logprobs: list[dict] = []  # per output token: {"token_id", "logprob", "top": [(id, logprob)]}
        # per prompt token, as logprobs (+ "rank"), once computed; the first token has none (None)
        self.prompt_logprobs: list[dict | None] = [None] if params.prompt_logprobs is not None else []
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0

    @property
    def cache_key(self) -> str | None:
        """What keys this sequence's prefix-cache blocks besides its tokens: the cache salt and the LoRA
        adapter (a load's unique id: latents computed under one adapter are not another's)."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora.lora_id}"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})")


@dataclass
class SequenceUpdate:
    """What one step did to a scheduled sequence: it computed `num_real` of its known tokens plus
    `num_accepted` verified draft tokens, and proposes `token_ids` to append (the accepted drafts and
    one sampled token; empty mid-prefill), with per token the logprob info (None if not asked). The
    engine appends them one at a time until a stop condition; tokens past it are discarded."""

    seq: Sequence
    num_real: int
    num_accepted: int = 0
    token_ids: list[int] = field(default_factory=list)
    infos: list[dict | None] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: fp32 logits (R, V) of the rows that predicted the sequence's
    # next R unscored prompt tokens (the first is token number len(seq.prompt_logprobs))
    prompt_logits: torch.Tensor | None = None


class SequenceAhead:
    """A view of `seq` as it will be once `extra` tokens follow it: what sampling reads (penalties over
    the output so far, min_tokens, the generator, the grammar matcher), for scoring a draft's position
    before it is accepted."""

    def __init__(self, seq: Sequence, extra: list[int]):
        self.params = seq.params
        self.token_ids = seq.token_ids + extra if extra else seq.token_ids
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.stop_token_ids = seq.stop_token_ids
        self.generator = seq.generator
        # a grammar's mask is its matcher's current state, right only with no extra tokens: constrained
        # sequences get no drafts (SpecDecoder.propose), so their rows are never scored ahead
        assert not (extra and seq.matcher is not None), "a constrained sequence has no drafts to score"
        self.matcher = seq.matcher

    num_output_tokens = Sequence.num_output_tokens  # the same properties over the extended tokens
    output_token_ids = Sequence.output_token_ids
