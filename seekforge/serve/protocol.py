"""OpenAI request schemas (pydantic) and their mapping onto SamplingParams.

Fields OpenAI defines but seekforge does not implement are accepted only at their "off" value, so a
request never silently gets behaviour it did not ask for; anything else is a 400 naming the field.
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, cache_salt) are accepted too, as `extra_body` in the openai client.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from seekforge.serve.sequence import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the request's usage and no choices
    continuous_usage_stats: bool = False  # vLLM: also every chunk carries the usage so far


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None

    def unsupported(self) -> str | None:
        """The first field set to something seekforge cannot do, with the reason, else None."""
        if self.logit_bias:
            return "logit_bias is not supported; remove it"
        if self.stream_options and not self.stream:
            return "stream_options is only allowed with stream=true"
        if self.stream_options and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:
            return "stream_options.continuous_usage_stats needs include_usage=true"
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported; remove it or set it to false"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of is not supported; use n"
        if self.suffix:
            return "suffix is not supported; remove it"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty; give a string, a list of token ids, or a list of either")
        return list(p)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are passed to the template
    role: str
    content: str | list[ContentPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported; remove them"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice is not supported; remove it"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format other than {'type': 'text'} is not supported"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs=true"
        return super().unsupported()

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM takes it: a PEFT adapter directory served under lora_name."""

    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str
