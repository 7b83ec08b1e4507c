"""Tokenizers: byte-level for the presets (offline, any text), `tokenizers` for checkpoints.

A checkpoint's tokenizer also carries what its `tokenizer_config.json` says for chat:
the `chat_template` and the special tokens the template may name (`bos_token`, ...).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

from pdctl.records import JSONValue


class Tokenizer(ABC):
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    chat_template: str | None = None  # None: the plain template (docs/http-api.md)
    special_tokens: dict[str, str] = {}  # noqa: RUF012  (bos_token, eos_token, ...)

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer(Tokenizer):
    """Token i < 256 is byte i; 256 is BOS, 257 EOS; the rest of the vocab decodes to ''."""

    BOS, EOS = 256, 257

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path, vocab_size: int) -> None:
        from tokenizers import Tokenizer as Backend

        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        self.backend = Backend.from_file(str(file))
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(_eos_ids(path))
        self.chat_template, self.special_tokens = _chat_config(path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=True))


def _eos_ids(path: Path) -> list[int]:
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            if isinstance(value, int):
                return [value]
            if isinstance(value, list):
                return [int(v) for v in value]
    return []


def _chat_config(path: Path) -> tuple[str | None, dict[str, str]]:
    """tokenizer_config.json's chat template (the default one when it names several, as
    transformers picks it) and its special tokens as text; a `chat_template.jinja` file
    beside it wins, as with transformers."""
    file = path / "tokenizer_config.json"
    config: dict[str, JSONValue] = {}
    if file.is_file():
        loaded = json.loads(file.read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    tokens: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return (template if isinstance(template, str) else None), tokens
