"""Tool calls in DeepSeek-V3's own format (its chat template's tool tokens), to and from OpenAI's shape.

An assistant turn that calls tools reads, as DeepSeek-V3's chat template writes it and vLLM's and
SGLang's `deepseek_v3` parsers read it:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": ...}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME2 ... <｜tool▁call▁end｜><｜tool▁calls▁end｜>

With the real DeepSeek tokenizer the markers are single special tokens; with the byte tokenizer they
are plain text. Either way parsing works on the decoded text (special tokens kept). `tool_choice`
"required" or a named function is enforced with a grammar over exactly this format (structured.py),
the arguments constrained by the function's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
ARGS_BEGIN, ARGS_END = "\n```json\n", "\n```" + CALL_END
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?P<type>[^\n]*?)" + re.escape(SEP) + r"(?P<name>[^\n]*)"
                   + re.escape(ARGS_BEGIN) + r"(?P<arguments>.*?)" + re.escape(ARGS_END), re.DOTALL)


def format_tool_calls(calls: list[dict]) -> str:
    """OpenAI tool_calls ([{"type": "function", "function": {"name", "arguments"}}]) → DeepSeek text."""
    body = "\n".join(f"{CALL_BEGIN}{c.get('type', 'function')}{SEP}{c['function']['name']}{ARGS_BEGIN}"
                     f"{c['function']['arguments']}{ARGS_END}" for c in calls)
    return CALLS_BEGIN + body + CALLS_END


def tool_system_prompt(tools: list[dict]) -> str:
    """DeepSeek-V3's template renders no tool list, so (as SGLang's DeepSeek-V3 tool template does) the
    tools and the call format go into the system prompt."""
    specs = "\n".join(json.dumps(t["function"], ensure_ascii=False, separators=(",", ":")) for t in tools)
    example = format_tool_calls([{"type": "function", "function": {"name": "NAME", "arguments": '{"ARG": "VALUE"}'}}])
    return (f"## Tools\nYou can call these functions:\n{specs}\n\nTo call functions, answer only with:\n{example}\n"
            "(several calls go one after another inside the same begin/end markers).")


def messages_for_template(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """OpenAI chat messages → messages any chat template renders: an assistant's tool_calls become its
    content in DeepSeek's format, and the tool list a system prompt (prepended to the first system
    message, or a new one)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m["content"] = (m.get("content") or "") + format_tool_calls(m.pop("tool_calls"))
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools:
        prompt = tool_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Model output → (content before the calls or None, OpenAI tool_calls). Text without a complete
    call is all content. Arguments are kept as the model wrote them (a JSON string, as OpenAI sends)."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return text, []
    calls = [new_tool_call(m["name"].strip(), m["arguments"]) for m in _CALL.finditer(text, start)]
    if not calls:
        return text, []
    return text[:start] or None, calls


def new_tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def check_tools(tools: list[dict] | None, tool_choice) -> list[dict]:
    """Validate `tools` + `tool_choice` (ValueError with the fix) → the tools the output may call."""
    tools = tools or []
    for t in tools:
        if t.get("type") != "function" or not isinstance(t.get("function"), dict) or not t["function"].get("name"):
            raise ValueError("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    names = [t["function"]["name"] for t in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tools: each function needs a name of its own; {repeated} stand more than once")
    if tool_choice in (None, "none", "auto"):
        return tools
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs tools; give tools or drop tool_choice")
    if tool_choice == "required":
        return tools
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                         f"{{'name': NAME}}}} naming one of the tools; got {tool_choice!r}")
    return chosen


def tool_call_grammar(tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call (or with `parallel` one or more) of these
    tools in DeepSeek's format, each call's arguments following its function's JSON schema (compact)."""
    rules, alternatives = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"call_{i}: {json.dumps(CALL_BEGIN + 'function' + SEP + fn['name'] + ARGS_BEGIN)} "
                     f"args_{i} {json.dumps(ARGS_END)}\nargs_{i}: %json {json.dumps(schema)}")
        alternatives.append(f"call_{i}")
    more = ' ("\\n" call)*' if parallel else ""
    return "\n".join([f"start: {json.dumps(CALLS_BEGIN)} call{more} {json.dumps(CALLS_END)}",
                      "call: " + " | ".join(alternatives), *rules])


@dataclass
class ToolCallStream:
    """Splits a growing output text into content deltas and OpenAI `tool_calls` deltas: content until
    the calls begin (held back while the text might be the start of the marker), then per call a
    first delta with id, type and name, then its arguments as they arrive."""

    sent_content: int = 0
    num_calls: int = 0  # calls whose header was sent
    sent_args: int = 0  # characters of the current call's arguments sent
    current_call_id: str = ""

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        start = text.find(CALLS_BEGIN)
        if start < 0:  # all content, except a tail that may still turn into the marker
            end = len(text) if final else _safe_end(text, CALLS_BEGIN)
            content, self.sent_content = text[self.sent_content:end], max(self.sent_content, end)
            return content, []
        content, self.sent_content = text[self.sent_content:start], max(self.sent_content, start)
        deltas = []
        pos, k = start, 0
        while True:
            head = text.find(CALL_BEGIN, pos)
            sep = text.find(SEP, head) if head >= 0 else -1
            args_at = text.find(ARGS_BEGIN, sep) if sep >= 0 else -1
            if args_at < 0:
                break
            args_start = args_at + len(ARGS_BEGIN)
            end = text.find(ARGS_END, args_start)
            if k == self.num_calls:  # a new call's header is complete
                call = new_tool_call(text[sep + len(SEP):args_at].strip(), "")
                self.current_call_id = call["id"]
                deltas.append({"index": k, **call})
                self.num_calls, self.sent_args = k + 1, 0
            if k == self.num_calls - 1:
                if end >= 0 or final:
                    stop = end if end >= 0 else len(text)
                else:
                    stop = args_start + _safe_end(text[args_start:], ARGS_END)
                new = text[args_start + self.sent_args:stop]
                if new:
                    deltas.append({"index": k, "function": {"arguments": new}})
                    self.sent_args += len(new)
            if end < 0:
                break
            pos, k = end + len(ARGS_END), k + 1
        return content, deltas


def _safe_end(text: str, marker: str) -> int:
    """How much of `text` can be sent: all but a tail that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)
