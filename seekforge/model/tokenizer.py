"""Tokenizers: a Hugging Face `tokenizer.json` through the `tokenizers` library, and a byte-level
tokenizer for the built-in corpora (no files, no download).

Both expose: encode(text, add_bos=False) → list[int], decode(ids) → str, vocab_size, bos_token_id,
eos_token_id, add_bos_token (whether a prompt should start with BOS),
apply_chat_template(messages, add_generation_prompt=True) → str, and save(directory),
which writes a `tokenizer.json` + `tokenizer_config.json` that `transformers.AutoTokenizer` loads and
that encodes exactly as the tokenizer itself does.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
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
        self.add_bos_token = False  # the built-in corpora train without one, so prompts get none either
        self.chat_template = self.CHAT_TEMPLATE
        self.bos_token, self.eos_token = self.SPECIALS[0], self.SPECIALS[1]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # A special token's text becomes its id, as HF tokenizers parse added tokens in text.
        ids = []
        for piece in _SPECIALS_PATTERN.split(text):
            special = self.SPECIALS.index(piece) if piece in self.SPECIALS else -1
            try:
                ids.extend([256 + special] if special >= 0 else piece.encode("utf-8"))
            except UnicodeEncodeError:
                check_unicode(text)
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

    def piece(self, token_id: int) -> str | None:
        """The token's string in the vocabulary, as transformers' convert_ids_to_tokens gives it for the saved
        tokenizer (`save`: GPT-2's stand-in symbol for a byte); None past the vocabulary."""
        if 0 <= token_id < 256:
            return _bytes_to_unicode()[token_id]
        special = token_id - 256
        return self.SPECIALS[special] if 0 <= special < len(self.SPECIALS) else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text; an id past the vocabulary: none)."""
        if 0 <= token_id < 256:
            return bytes([token_id])
        special = token_id - 256
        return self.SPECIALS[special].encode() if 0 <= special < len(self.SPECIALS) else b""

    def save(self, directory: str | Path) -> None:
        """The same tokenizer as a `tokenizers` byte-level BPE with no merges: GPT-2's byte-to-unicode
        alphabet maps byte b to one symbol whose id is b, and the specials keep ids 256–258."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from tokenizers.pre_tokenizers import ByteLevel

        alphabet = ByteLevel.alphabet()  # the 256 symbols standing for bytes 0-255, in no byte order
        symbol_of_byte = _bytes_to_unicode()
        assert sorted(alphabet) == sorted(symbol_of_byte.values())
        vocab = {symbol_of_byte[b]: b for b in range(256)}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(list(self.SPECIALS))
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                  "eos_token": self.eos_token, "pad_token": self.SPECIALS[2], "add_bos_token": False,
                  "add_eos_token": False, "clean_up_tokenization_spaces": False, "chat_template": self.chat_template}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


class HFTokenizer:
    """A `tokenizer.json` directory; special tokens and chat template from `tokenizer_config.json`."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise ValueError(f"no tokenizer.json at {path}; pass a directory holding one, or --tokenizer byte")
        self.file = file
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
        # Whether text (a prompt) starts with BOS: as the tokenizer's config says, like transformers;
        # seekforge's own data pipeline encodes without one.
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = config.get("chat_template") or ByteTokenizer.CHAT_TEMPLATE
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:  # the Rust side's "TextInputSequence must be str", also for a str it cannot convert
            if isinstance(text, str):
                check_unicode(text)
            raise
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def piece(self, token_id: int) -> str | None:
        """The token's string in the vocabulary (transformers' convert_ids_to_tokens); None past it."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also where they are part of a character (a byte-level BPE piece, a
        SentencePiece byte-fallback <0xNN>); a special token: its text; an id past the vocabulary: none."""
        piece = self.piece(token_id)
        if piece is None:
            return b""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        byte_of = _byte_of_symbol()
        if all(ch in byte_of for ch in piece):
            return bytes(byte_of[ch] for ch in piece)
        return text.encode()

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for file in (self.file, self.file.parent / "tokenizer_config.json"):
            if file.exists() and file.parent.resolve() != directory.resolve():
                shutil.copy(file, directory / file.name)


def check_unicode(text: str) -> None:
    """ValueError for text no tokenizer can encode: text with a lone surrogate (JSON's "\\ud800" decodes to one),
    which is not a Unicode character and has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"the text holds a lone surrogate {text[err.start]!r} (at character {err.start}), which "
                         "is not valid Unicode; send UTF-8 text, a surrogate pair for characters past U+FFFF") from None


_SPECIALS_PATTERN = re.compile("(" + "|".join(re.escape(t) for t in ByteTokenizer.SPECIALS) + ")")


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


@functools.cache
def _byte_of_symbol() -> dict[str, int]:
    return {symbol: b for b, symbol in _bytes_to_unicode().items()}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what `tokenizers`' ByteLevel works on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = dict(zip(printable, map(chr, printable), strict=True)), 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


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
