"""The engine: requests in, completions out.

    LLMEngine   — synchronous core: add_request / abort / step. One step = schedule → run → sample →
                  update sequences (stop checks, incremental detokenization: detokenizer.py) →
                  finished sequences release their blocks. With `speculative_tokens` the run + sample
                  is spec_decode.py's verify and the step ends with MTP drafts; with
                  `num_scheduler_steps` an all-decode batch runs N steps on the model side
                  (Runner.decode_steps) before the updates; LoRA adapters: lora.py.
    LLM         — offline API: `LLM("tiny").generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8))`.
The server drives an LLMEngine through async_engine.AsyncEngine.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from seekforge.config import EngineConfig
from seekforge.model.model import Transformer
from seekforge.serve.block_manager import BlockManager
from seekforge.serve.detokenizer import IncrementalDetokenizer
from seekforge.serve.lora import LoRAAdapter, load_adapter
from seekforge.serve.runner import Runner, num_kv_blocks
from seekforge.serve.sampling import logprob_infos, sample, sample_ids, token_logprobs
from seekforge.serve.scheduler import Scheduler
from seekforge.serve.sequence import SamplingParams, Sequence, SequenceUpdate
from seekforge.serve.spec_decode import SpecDecoder
from seekforge.serve.structured import GrammarCompiler

log = logging.getLogger("seekforge.serve")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict] | None  # per token: {"token_id", "logprob", "top": [(id, logprob), ...]}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    ttft: float | None = None  # seconds from arrival to the first token (first completion)
    tpot: float | None = None  # seconds per output token after the first (finished requests)
    # with SamplingParams.prompt_logprobs: per prompt token as CompletionOutput.logprobs (+ "rank");
    # the first token's is None (nothing predicts it)
    prompt_logprobs: list[dict | None] | None = None


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """A conversation through the tokenizer's chat template, as token ids. BOS is added where the
    tokenizer adds one to prompts (`add_bos_token`) and the template did not already write it (HF
    templates usually start with `{{ bos_token }}`): never twice."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt)
    bos_token = getattr(tokenizer, "bos_token", None)
    has_bos = bool(bos_token) and text.startswith(bos_token)
    return tokenizer.encode(text, add_bos=getattr(tokenizer, "add_bos_token", False) and not has_bos)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]  # one per sequence: its output text
    # only the finished request's output is wanted (vLLM's RequestOutputKind.FINAL_ONLY: `generate`, a rollout, a
    # non-streaming completion): no cumulative output per step, whose token ids, text and logprobs are copies
    final_only: bool = False


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer, config: EngineConfig | None = None, make_runner=Runner):
        """make_runner(model, config, num_blocks): the Runner (serve/distributed.py passes a sharded one)."""
        self.config = config = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.cfg
        self.max_model_len = config.model_len(cfg.max_position_embeddings)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}; lower it")
        num_blocks = num_kv_blocks(model, config)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = make_runner(model, config, num_blocks)
        self.spec = SpecDecoder(self.runner, self.block_manager, config.speculative_tokens, self.max_model_len) \
            if config.speculative_tokens else None
        self.capacity = num_blocks * config.block_size
        self.eos_token_id = tokenizer.eos_token_id
        self.grammars = GrammarCompiler(tokenizer, cfg.vocab_size)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_aborted = 0
        per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers
        log.info("KV cache: %d blocks x %d tokens = %d max concurrent tokens (%.1f MiB, %d values/token)",
                 num_blocks, config.block_size, self.capacity,
                 sum(c.c_kv.nbytes + c.k_pe.nbytes for c in self.runner.caches) / 2**20, per_token)

    # ------------------------------------------------------------------ requests
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, cache_salt: str | None = None,
                     lora_name: str | None = None, final_only: bool = False) -> Request:
        """Validate and tokenize, touching no engine state (safe from any thread). `lora_name`: a loaded
        LoRA adapter to run the request with (None: the base model). `final_only`: `step` returns the request's
        output once, when it finishes (else every step it got tokens in)."""
        params = params or SamplingParams()
        lora = self._lora(lora_name)
        if isinstance(prompt, str):  # a BOS only if training put one there (the tokenizer's add_bos_token)
            prompt_ids = self.tokenizer.encode(prompt, add_bos=getattr(self.tokenizer, "add_bos_token", False))
        else:
            prompt_ids = [int(t) for t in prompt]
        vocab = self.model.cfg.vocab_size
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens but the context length is {limit}; shorten the "
                             "prompt so at least one token can be generated")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
                             f"context length {limit}; lower max_tokens to at most {limit - n}")
        if n + max_tokens + self.config.speculative_tokens > self.capacity:
            raise ValueError(f"the request needs {n + max_tokens} tokens of KV cache (+ "
                             f"{self.config.speculative_tokens} draft slots) but it holds {self.capacity}; lower "
                             "max_tokens or raise --kv-cache-memory")
        if not self.config.enable_chunked_prefill and n + max_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"without chunked prefill a sequence of up to {n + max_tokens} tokens must fit one "
                             f"step (max_num_batched_tokens={self.config.max_num_batched_tokens}); enable "
                             "chunked prefill or raise max_num_batched_tokens")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        seqs = [Sequence(request_id, i, prompt_ids, params, max_tokens, self.eos_token_id, cache_salt, lora)
                for i in range(params.n)]
        if params.structured is not None:
            for seq in seqs:  # matcher state is per sequence: each of the n completions advances its own
                seq.matcher = self.grammars.matcher(params.structured)
        detokenizers = [IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens) for _ in seqs]
        return Request(request_id, prompt_ids, seqs, detokenizers, final_only)

    def add(self, request: Request) -> str:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running; use a unique id")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        return request.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, lora_name: str | None = None) -> str:
        return self.add(self.make_request(prompt, params, request_id, cache_salt, lora_name))

    # ------------------------------------------------------------------ LoRA adapters (lora.py)
    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter under `name`; requests select it by that name. Safe from any thread:
        the engine only ever sees the adapter once it is complete."""
        self._lora_manager().add(load_adapter(name, path, self.model))

    def unload_lora(self, name: str) -> None:
        """New requests can no longer use `name`; running ones finish with it. KeyError if not loaded."""
        self._lora_manager().remove(name)

    @property
    def lora_adapters(self) -> dict[str, LoRAAdapter]:
        return dict(self.runner.lora.adapters) if self.runner.lora is not None else {}

    def _lora_manager(self):
        if self.runner.lora is None:
            raise ValueError("LoRA adapters are off; start the engine with enable_lora=True (seekforge serve "
                             "--enable-lora, or --lora-modules name=path)")
        return self.runner.lora

    def _lora(self, name: str | None) -> LoRAAdapter | None:
        if name is None:
            return None
        adapter = self.lora_adapters.get(name)
        if adapter is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self.lora_adapters)}")
        return adapter

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.num_aborted += 1
        for seq, detokenizer in zip(request.seqs, request.detokenizers, strict=True):
            if not seq.is_finished:
                self._finish(seq, detokenizer, "abort")
        return self._output(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Call after changing the model's weights in place (e.g. between GRPO steps)."""
        self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the (cumulative) outputs of requests that got tokens or finished (of a
        `final_only` request, only once it finished)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            assert not self.scheduler.running, "scheduled nothing while sequences run"
            return []
        num_steps = self.scheduler.num_decode_steps(batch, self.max_model_len)
        if num_steps > 1:
            return self._multi_step(batch.seqs, num_steps)
        updates = self.spec.verify(batch) if self.spec else self._plain_step(batch)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for update in updates:
            if self._apply(update, now):
                touched[update.seq.request_id] = self.requests[update.seq.request_id]
        if self.spec:
            self.spec.propose()
        self.num_steps += 1
        return self._outputs(touched)

    def _multi_step(self, seqs: list[Sequence], num_steps: int) -> list[RequestOutput]:
        """Run `num_steps` decode steps on the model side, then apply them token by token: stop checks and
        streamed outputs stay per token; a stopped sequence's later tokens are discarded (its slots are
        freed with it)."""
        steps = self.runner.decode_steps(seqs, num_steps, lambda logits: sample_ids(logits, seqs))
        outputs = []
        for ids, logits in steps:
            now = time.monotonic()
            touched: dict[str, Request] = {}
            tokens = ids.tolist()
            for seq, token, info in zip(seqs, tokens, logprob_infos(logits, ids, seqs, tokens), strict=True):
                if not seq.is_finished and self._apply(SequenceUpdate(seq, 1, 0, [token], [info]), now):
                    touched[seq.request_id] = self.requests[seq.request_id]
            outputs += self._outputs(touched)
        self.num_steps += num_steps
        return outputs

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if request.final_only and not all(s.is_finished for s in request.seqs):
                continue
            out = self._output(request)
            if out.finished:
                del self.requests[request.request_id]
            outputs.append(out)
        return outputs

    def _plain_step(self, batch) -> list[SequenceUpdate]:
        logits, sample_seqs, prompt_logits = self.runner.run(batch)
        token_ids, infos = sample(logits, sample_seqs) if sample_seqs else ([], [])
        sampled = {seq.seq_id: (t, i) for seq, t, i in zip(sample_seqs, token_ids, infos, strict=True)}
        prompt_logits = {seq.seq_id: rows for seq, rows in prompt_logits}
        updates = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            token, info = sampled.get(seq.seq_id, (None, None))
            updates.append(SequenceUpdate(seq, n, 0, [] if token is None else [token], [] if token is None else [info],
                                          prompt_logits.get(seq.seq_id)))
        return updates

    def _apply(self, update: SequenceUpdate, now: float) -> bool:
        """Append an update's tokens one at a time until a stop condition (the rest are discarded), advance
        the computed tokens (accepted drafts count, tokens past a stop do not), register full blocks
        for prefix caching, finish a stopped sequence. True if the sequence got tokens."""
        seq = update.seq
        if update.prompt_logits is not None:
            first = len(seq.prompt_logprobs)
            seq.prompt_logprobs.extend(token_logprobs(update.prompt_logits, seq.token_ids[first:first + len(
                update.prompt_logits)], seq.params.prompt_logprobs))
        detokenizer = self.requests[seq.request_id].detokenizers[seq.index]
        reason, kept = None, 0
        for token_id, info in zip(update.token_ids, update.infos, strict=True):
            seq.token_ids.append(token_id)
            kept += 1
            if seq.matcher is not None:
                seq.matcher.consume_token(token_id)  # the mask allowed it, so the grammar accepts it
            if seq.first_token_time is None:
                seq.first_token_time = now
            if info is not None:
                seq.logprobs.append(info)
            reason = self._stop_reason(seq, token_id, detokenizer)
            if reason is not None:
                break
        seq.num_computed_tokens += update.num_real + min(update.num_accepted, kept)
        self.block_manager.cache_full_blocks(seq)
        if reason is not None:
            seq.finish_time = now
            self._finish(seq, detokenizer, reason)
        return kept > 0

    def _stop_reason(self, seq: Sequence, token_id: int, detokenizer: IncrementalDetokenizer) -> str | None:
        """Why seq ends after its new token: "stop", "length", "abort" (the grammar library gave up on its structured
        output, which is then no complete one; the error is logged), or None to go on. Every token but a stop token
        goes to the text (the stop token stays in token_ids only)."""
        past_min_tokens = seq.num_output_tokens >= seq.params.min_tokens
        if token_id in seq.stop_token_ids and past_min_tokens:
            return "stop"
        stop_string = detokenizer.add(token_id, check_stop=past_min_tokens)
        if seq.matcher is not None and seq.matcher.is_error():  # e.g. a regex whose lexer grows too large
            log.warning("request %s: structured output failed after %d tokens, ending it as 'abort': %s",
                        seq.request_id, seq.num_output_tokens, seq.matcher.get_error().splitlines()[0])
            return "abort"
        if stop_string:
            return "stop"  # a stop string completed; the text ends just before it
        if seq.matcher is not None and seq.matcher.is_stopped():
            return "stop"  # the structured output is complete: the grammar allows nothing more
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, detokenizer: IncrementalDetokenizer, reason: str) -> None:
        detokenizer.finish(check_stop=seq.num_output_tokens >= seq.params.min_tokens)
        self.scheduler.finish(seq, reason)

    def _output(self, request: Request) -> RequestOutput:
        seqs = request.seqs
        # while running, only text that can no longer change or be cut by a stop string
        outputs = [CompletionOutput(s.index, d.text if s.is_finished else d.streamable_text, s.output_token_ids,
                                    s.finish_reason, list(s.logprobs) if s.params.logprobs is not None else None)
                   for s, d in zip(seqs, request.detokenizers, strict=True)]
        finished = all(s.is_finished for s in seqs)
        first = [s.first_token_time for s in seqs if s.first_token_time is not None]
        ttft = min(first) - seqs[0].arrival_time if first else None
        tpot = None
        if finished:
            decode_times = [(s.finish_time - s.first_token_time) / (s.num_output_tokens - 1)
                            for s in seqs if s.finish_time and s.first_token_time and s.num_output_tokens > 1]
            tpot = sum(decode_times) / len(decode_times) if decode_times else None
        prompt_logprobs = list(seqs[0].prompt_logprobs) if seqs[0].params.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished,
                             seqs[0].num_cached_tokens, ttft, tpot, prompt_logprobs)

    def stats(self) -> dict:
        bm = self.block_manager
        stats = {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                 "kv_cache_usage": bm.usage, "prefix_cache_hit_rate": bm.prefix_hit_rate,
                 "num_free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks,
                 "num_preemptions": self.scheduler.num_preemptions, "num_aborted": self.num_aborted}
        if self.spec:
            stats.update(spec_num_draft_tokens=self.spec.num_draft_tokens,
                         spec_num_accepted_tokens=self.spec.num_accepted_tokens,
                         spec_acceptance_rate=self.spec.acceptance_rate,
                         spec_mean_accepted_length=self.spec.mean_accepted_length)
        return stats


def drain(engine, ids: list[str]) -> list[RequestOutput]:
    """Step `engine` (an LLMEngine, or serve/distributed.py's DistributedEngine) until the requests
    `ids` finish → their final outputs, in that order."""
    done: dict[str, RequestOutput] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


class LLM:
    """Offline batched generation: `LLM("tiny").generate(prompts, SamplingParams(...))`.

    `model`: a preset name, an HF-format checkpoint directory, or a built `Transformer` (then pass
    `tokenizer`, default the byte tokenizer). `dtype` for a loaded model: "auto" (bf16 where the
    hardware runs it fast for this model's width: model/precision.resolve_dtype), "bf16", "fp32" or a
    torch dtype. Other keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str | Transformer = "tiny", tokenizer=None, dtype: str | torch.dtype = "auto",
                 **engine_kwargs):
        from seekforge.model.load import model_width
        from seekforge.model.precision import resolve_dtype
        from seekforge.model.tokenizer import load_tokenizer
        from seekforge.quant.load import load_model  # quantized checkpoints too

        if isinstance(model, Transformer):
            tokenizer = tokenizer or load_tokenizer("byte")
        else:
            dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, hidden_size=model_width(model))[0]
            model, loaded_tokenizer = load_model(model, dtype)
            tokenizer = tokenizer or loaded_tokenizer
        self.engine = LLMEngine(model, tokenizer, EngineConfig(**engine_kwargs))
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_name: str | list[str | None] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Outputs come in prompt order.
        lora_name: a loaded LoRA adapter for every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts; give one or "
                             "one per prompt")
        engine = self.engine
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        requests = [engine.make_request(p, sp, lora_name=lora, final_only=True)
                    for p, sp, lora in zip(prompts, sampling_params, loras, strict=True)]
        return drain(engine, [engine.add(r) for r in requests])  # all validated first: a bad prompt adds nothing

    def reset_prefix_cache(self) -> None:
        """The engine shares the model object: after updating its weights in place (GRPO), call this
        so no request reuses latents computed with the old weights."""
        self.engine.reset_prefix_cache()

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([chat_prompt_ids(self.tokenizer, c) for c in conversations], sampling_params)
