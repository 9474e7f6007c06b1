"""Incremental detokenization: one sequence's output text, grown one token at a time in O(1) per token.

Decoding the whole output again at every step costs O(n) per token (O(n²) per request). Instead, as
HF's `DecodeStream` and vLLM's `detokenize_incrementally` do, only a short window of tokens is decoded:

    ids:  ... | prefix_offset ........ read_offset ........ len(ids)
                 └ context, already emitted ┘└ not yet emitted ┘
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

The context tokens are decoded again so that tokenizers whose text for a token depends on what comes
before it (SentencePiece's leading space) produce the right delta. A window whose text ends in U+FFFD
may be a multi-byte UTF-8 character split across tokens: nothing is emitted until a later token
completes it (or the sequence finishes, when the one-shot decode would show U+FFFD too). So the
deltas concatenate to exactly `tokenizer.decode(all_ids)`: tests/serve/test_detokenizer.py checks
that property on random (also invalid) byte sequences with the byte tokenizer and a BPE tokenizer.

Stop strings are matched on the text as it grows, so one spanning several tokens is found at the
token completing it, and the text is cut just before it. While a sequence runs, `streamable_text`
holds back a tail that could still be the start of a stop string, so a streamed delta is never
text that a later cut removes.
"""

from __future__ import annotations

import functools

REPLACEMENT_CHAR = "\ufffd"  # what a decoder returns for bytes that are not (yet) valid UTF-8


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far; cut before the stop string once one matched
        self.stopped = False  # a stop string matched: the text is final

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append one output token; True if it completed a stop string (then `text` ends just before
        the earliest one). `check_stop=False` (before min_tokens) lets stop strings pass."""
        assert not self.stopped, "no tokens after a stop string"
        self.token_ids.append(token_id)
        return self._extend(self._decode_window(final=False), check_stop)

    def finish(self, check_stop: bool = True) -> None:
        """The sequence ended (length, stop token, abort): emit what was held back, as the one-shot
        decode shows it (a trailing partial character becomes U+FFFD, which a stop string may hold)."""
        if not self.stopped:
            self._extend(self._decode_window(final=True), check_stop)

    @property
    def streamable_text(self) -> str:
        """The text a stream may send now: all of it but a tail that a stop string could still claim."""
        if self.stopped or not self.stop:
            return self.text
        return self.text[:len(self.text) - self._stop_prefix_len()]

    # ------------------------------------------------------------------ internals
    def _extend(self, delta: str, check_stop: bool) -> bool:
        if not delta:
            return False
        old_len = len(self.text)
        self.text += delta
        cut = self._first_completed_stop(old_len) if check_stop else None
        if cut is None:
            return False
        self.text = self.text[:cut]
        self.stopped = True
        return True

    def _decode_window(self, final: bool) -> str:
        decode = self.tokenizer.decode  # the tokenizer interface's default skips special tokens
        if not self.skip_special_tokens:
            decode = functools.partial(decode, skip_special_tokens=False)
        ids = self.token_ids
        prefix_text = decode(ids[self.prefix_offset:self.read_offset])
        window_text = decode(ids[self.prefix_offset:])
        if len(window_text) <= len(prefix_text) or (window_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing new yet, or maybe a character whose remaining bytes are still to come
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return window_text[len(prefix_text):]

    def _first_completed_stop(self, old_len: int) -> int | None:
        """Start of the stop string whose match ends first past `old_len` (ties: the longer one), as if
        the text had grown one character at a time; None if no stop string ends in the new text."""
        best = None
        for s in self.stop:
            start = self.text.find(s, max(0, old_len - len(s) + 1))  # only matches ending in the new text
            if start >= 0:
                key = (start + len(s), start)
                best = key if best is None or key < best else best
        return None if best is None else best[1]

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self.text
        return max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)
