"""Tokenizers: a Hugging Face `tokenizer.json` through the `tokenizers` library, and a byte-level
tokenizer for the built-in corpora (no files, no download).

Both expose: encode(text, add_bos=False) → list[int], decode(ids) → str, vocab_size, bos_token_id,
eos_token_id, apply_chat_template(messages, add_generation_prompt=True) → str.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.sandbox


class ByteTokenizer:
    """UTF-8 bytes are ids 0–255; then <|bos|>, <|eos|>, <|pad|>."""

    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
    # A plain-text chat format, used when no HF chat template exists.
    CHAT_TEMPLATE = (
        "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    )

    def __init__(self):
        self.bos_token_id, self.eos_token_id, self.pad_token_id = 256, 257, 258
        self.vocab_size = 259
        self.chat_template = self.CHAT_TEMPLATE
        self.bos_token, self.eos_token = self.SPECIALS[0], self.SPECIALS[1]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens and i - 256 < len(self.SPECIALS):
                out.extend(self.SPECIALS[i - 256].encode())
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token="", eos_token="")


class HFTokenizer:
    """A `tokenizer.json` directory; special tokens and chat template from `tokenizer_config.json`."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise ValueError(f"no tokenizer.json at {path}; pass a directory holding one, or --tokenizer byte")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust error says little; name the file
            raise ValueError(f"{file} is not a valid tokenizer.json ({e})") from e
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_token_id = self.eos_token_id
        self.chat_template = config.get("chat_template") or ByteTokenizer.CHAT_TEMPLATE
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool, **special) -> str:
    """Render an HF chat template as transformers does: sandboxed Jinja, trim_blocks/lstrip_blocks."""

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **special)


def load_tokenizer(name_or_path: str | Path | None):
    """"byte" (or None) → ByteTokenizer; a directory or tokenizer.json path → HFTokenizer."""
    if name_or_path is None or str(name_or_path) == "byte":
        return ByteTokenizer()
    return HFTokenizer(name_or_path)
