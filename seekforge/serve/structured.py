"""Structured output: a grammar (JSON schema, regex, choice, Lark) constrains sampling, token by token.

The grammar library is llguidance (the engine vLLM's `guidance` backend and SGLang use): it compiles
the constraint against the tokenizer's vocabulary and, per sequence, an `LLMatcher` says which tokens
may come next (a bitmask over the vocabulary) and advances on each accepted token. Sampling sets the
disallowed logits to -inf; the engine feeds every sampled token back to the sequence's matcher and
ends the sequence ("stop") once the grammar is complete. Nothing here parses JSON by hand.

JSON is generated compact (no optional whitespace), so a model cannot spend its token budget on
blanks; a response cut by max_tokens is reported with finish_reason "length" (and is then
incomplete, as in OpenAI and vLLM).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import llguidance
import torch

_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint, as vLLM's `structured_outputs` names them: exactly one field is set."""

    json: dict | str | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured output needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")

    @classmethod
    def from_dict(cls, spec: dict) -> StructuredOutput:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unsupported key(s) {unknown}; use one of {sorted(known)}")
        return cls(**spec)

    @classmethod
    def from_response_format(cls, fmt: dict) -> StructuredOutput:
        """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"name", "schema", "strict"}}."""
        kind = fmt.get("type")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs json_schema.schema (a JSON schema object)")
            return cls(json=schema)
        raise ValueError(f"response_format type {kind!r} is not supported; use text, json_object or json_schema")

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (its JSON form)."""
        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if isinstance(self.json, str) else (self.json or {"type": "object"})
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # JSON string literals are valid Lark string literals
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


class GrammarCompiler:
    """The tokenizer as llguidance sees it (built once, on first use) and matchers made from it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            # Every seekforge tokenizer saves a tokenizer.json (the byte tokenizer as a byte-level BPE
            # with no merges), which is what llguidance reads; the model's vocabulary may be padded
            # past the tokenizer's, and those ids are never allowed.
            with tempfile.TemporaryDirectory() as tmp:
                self.tokenizer.save(tmp)
                text = (Path(tmp) / "tokenizer.json").read_text()
            self._ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                        eos_token=self.tokenizer.eos_token_id)
        return self._ll_tokenizer

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh per-sequence matcher; ValueError if the grammar does not compile."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, spec.grammar_text())
        if matcher.is_error():
            raise ValueError(f"structured output: the constraint does not compile: {matcher.get_error()}")
        return matcher


def allowed_tokens(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """→ (M, V) bool: which tokens each matcher allows next."""
    # llguidance.torch is not used: importing it runs a torch.compile decorator (loads dynamo)
    bitmask = torch.stack([torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
                           for m in matchers])  # (M, ceil(V/32)): bit j of word w is token 32 w + j
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (M, W, 32): bit j of word w
    return bits.reshape(len(matchers), -1)[:, :vocab_size].bool()  # token id = 32 w + j
