"""OpenAI request schemas (pydantic) and their mapping onto SamplingParams.

Fields OpenAI defines but seekforge does not implement are accepted only at their "off" value, so a
request never silently gets behaviour it did not ask for; anything else is a 400 naming the field.
vLLM's extra fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
cache_salt, skip_special_tokens, prompt_logprobs, guided_json / guided_regex / guided_choice / guided_grammar,
structured_outputs) are accepted too, as `extra_body` in the openai client.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from seekforge.errors import InvalidSetting
from seekforge.serve.sequence import SamplingParams
from seekforge.serve.structured import StructuredOutput


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the request's usage and no choices
    continuous_usage_stats: bool = False  # vLLM: also every chunk carries the usage so far


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON's NaN / Infinity: a 400 naming the field
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
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None  # vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}

    def structured(self) -> StructuredOutput | None:
        """The one constraint the request sets (response_format, guided_*, structured_outputs), if any;
        ValueError if it sets several or a malformed one."""
        found = []
        fmt = self.response_format
        if fmt is not None and fmt.get("type") != "text":
            found.append(StructuredOutput.from_response_format(fmt))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        if any(v is not None for v in guided.values()):
            found.append(StructuredOutput(**{k: v for k, v in guided.items() if v is not None}))
        if self.structured_outputs:
            found.append(StructuredOutput.from_dict(self.structured_outputs))
        if len(found) > 1:
            raise ValueError("give one of response_format, guided_* and structured_outputs, not several")
        return found[0] if found else None

    def check_supported(self) -> None:
        """InvalidSetting (the field, the reason) for the first field set to something seekforge cannot do."""
        if self.logit_bias:
            raise InvalidSetting("logit_bias", "logit_bias is not supported; remove it")
        if self.stream_options and not self.stream:
            raise InvalidSetting("stream_options", "stream_options is only allowed with stream=true")
        if self.stream_options and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:
            raise InvalidSetting("stream_options.continuous_usage_stats",
                                 "stream_options.continuous_usage_stats needs include_usage=true")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs, structured=self.structured(),
            skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidSetting("max_tokens", "max_tokens=0 only makes sense with echo=true (score the prompt); give "
                                               "max_tokens >= 1")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidSetting("best_of", "best_of is not supported; use n")
        if self.suffix:
            raise InvalidSetting("suffix", "suffix is not supported; remove it")
        super().check_supported()

    def completion_params(self) -> SamplingParams:
        """max_tokens 0 with echo (scoring a prompt, as lm-eval does) runs one step like vLLM and shows
        only the prompt; echo's prompt logprobs have `logprobs` top entries, as in vLLM."""
        params = self.sampling_params(1 if self.max_tokens == 0 else self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = max(self.logprobs, params.prompt_logprobs or 0)
        return params

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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant message's call of a tool (OpenAI's `tool_calls` entries)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ...: passed on to the tool prompt
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """Validated tools as the plain dicts tools.py reads."""
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are passed to the template
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None

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
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:  # else reported as max_tokens
            raise InvalidSetting("max_completion_tokens",
                                 f"max_completion_tokens={self.max_completion_tokens}: must be an integer >= 1")
        if self.top_logprobs and not self.logprobs:
            raise InvalidSetting("top_logprobs", "top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidSetting("top_logprobs", f"top_logprobs={self.top_logprobs}: must be in [0, 20]")
        super().check_supported()

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM takes it: a PEFT adapter directory served under lora_name."""

    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` (through the chat template, with `tools`)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    return_token_strs: bool = False

    def model_post_init(self, _):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.prompt is not None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
