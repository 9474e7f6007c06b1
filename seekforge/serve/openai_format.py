"""The engine's outputs in OpenAI's response shapes: choices (completion text with echo, chat messages
and deltas with tool calls), logprobs (completions' token lists and text offsets, chat's per-token
entries, vLLM's prompt_logprobs) and usage. Pure functions of RequestOutputs and the tokenizer;
routes.py calls them, streaming.py puts them in SSE chunks."""

from __future__ import annotations

import codecs

from seekforge.serve.engine import RequestOutput
from seekforge.serve.tools import ToolCallStream, parse_tool_calls


def usage(finals: list[RequestOutput], scored_only: bool = False) -> dict:
    """OpenAI's usage; scored_only: max_tokens=0 with echo, whose one token the engine ran is not shown, nor counted."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = 0 if scored_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}


def token_bytes(tokenizer, token_id: int) -> bytes:
    as_bytes = getattr(tokenizer, "token_bytes", None)  # seekforge's tokenizers; another: its decoded text
    return as_bytes(token_id) if as_bytes else tokenizer.decode([token_id]).encode()


def piece(tokenizer, token_id: int) -> str | None:
    """The token's vocabulary string, as vLLM's /tokenize returns it (convert_ids_to_tokens)."""
    vocab_piece = getattr(tokenizer, "piece", None)
    return vocab_piece(token_id) if vocab_piece else tokenizer.decode([token_id])


def single_token_text(tokenizer, token_id: int) -> str:
    """One token as logprobs show it: its text, or where its bytes are part of a character, "bytes:\\xNN…" (as
    OpenAI writes such tokens), so that distinct tokens never read the same."""
    data = token_bytes(tokenizer, token_id)
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def prompt_entries(out: RequestOutput) -> list[dict]:
    """The prompt's logprob entries for echo: the first token has no logprob (null), as in OpenAI."""
    first = {"token_id": out.prompt_token_ids[0], "logprob": None, "top": None}
    return [first, *out.prompt_logprobs[1:]]


def completion_logprobs(tokenizer, entries: list[dict]) -> dict:
    tokens = [single_token_text(tokenizer, e["token_id"]) for e in entries]
    # each token's first character in the decoded text: bytes decoded as they come, a character split over tokens
    # counted where it ends
    decoder, offsets, pos = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(decoder.decode(token_bytes(tokenizer, e["token_id"])))
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {single_token_text(tokenizer, i): lp for i, lp in e["top"]}
                             for e in entries],
            "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer, out: RequestOutput) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {"logprob", "rank",
    "decoded_token"}} holding the prompt token and the top k."""
    result: list[dict | None] = [None]
    for e in out.prompt_logprobs[1:]:
        entry = {str(e["token_id"]): {"logprob": e["logprob"], "rank": e["rank"],
                                      "decoded_token": single_token_text(tokenizer, e["token_id"])}}
        for rank, (i, lp) in enumerate(e["top"], 1):
            entry.setdefault(str(i), {"logprob": lp, "rank": rank, "decoded_token": single_token_text(tokenizer, i)})
        result.append(entry)
    return result


def chat_logprobs(tokenizer, entries: list[dict]) -> list[dict]:
    def one(token_id, logprob):
        return {"token": single_token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": list(token_bytes(tokenizer, token_id))}

    return [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(i, lp) for i, lp in e["top"]]}
            for e in entries]


class CompletionChoices:
    """/v1/completions choices, called per choice (and, streaming, per chunk) as
    `(index, output, new text, new logprob entries or None, finish reason)`. Echo and vLLM's
    prompt_logprobs go in a choice's first chunk only; `max_tokens: 0` (scoring a prompt, as lm-eval
    sends) shows the prompt, not the one token the engine ran."""

    def __init__(self, tokenizer, req):
        self.tokenizer, self.req = tokenizer, req
        self.echo_only = req.max_tokens == 0
        self.started: set[int] = set()  # choices whose first chunk went out

    def __call__(self, i: int, out: RequestOutput, text: str, logprob_entries, finish_reason) -> dict:
        first = i not in self.started
        self.started.add(i)
        if self.echo_only:
            text, logprob_entries = "", [] if logprob_entries is not None else None
            finish_reason = finish_reason and "length"
        if self.req.echo and first:
            text = self.tokenizer.decode(out.prompt_token_ids) + text
            if logprob_entries is not None:
                logprob_entries = prompt_entries(out) + logprob_entries
        body = {"index": i, "text": text, "finish_reason": finish_reason,
                "logprobs": completion_logprobs(self.tokenizer, logprob_entries) if logprob_entries is not None
                else None}
        if self.req.prompt_logprobs is not None and first:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, out)
        return body


class ChatChoices:
    """/v1/chat/completions choices: whole messages, or (`delta`) streamed deltas. With tools, the text is
    parsed into `tool_calls` (streaming: a ToolCallStream per choice holds back a call until it is whole)
    and a stop after a call is finish reason "tool_calls"."""

    def __init__(self, tokenizer, use_tools: bool, delta: bool):
        self.tokenizer, self.use_tools, self.delta = tokenizer, use_tools, delta
        self.tool_streams: dict[int, ToolCallStream] = {}

    def __call__(self, i: int, out: RequestOutput, text: str, logprob_entries, finish_reason) -> dict:
        lp = {"content": chat_logprobs(self.tokenizer, logprob_entries)} if logprob_entries is not None else None
        body: dict = {} if self.delta else {"role": "assistant"}
        if self.use_tools and self.delta:
            stream = self.tool_streams.setdefault(i, ToolCallStream())
            content, calls = stream.update(out.outputs[i].text, finish_reason is not None)
            if finish_reason == "stop" and stream.num_calls:
                finish_reason = "tool_calls"
        elif self.use_tools:
            content, calls = parse_tool_calls(text)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            content, calls = text, None
        body["content"] = content
        if calls:
            body["tool_calls"] = calls
        return {"index": i, "delta" if self.delta else "message": body, "logprobs": lp,
                "finish_reason": finish_reason}
