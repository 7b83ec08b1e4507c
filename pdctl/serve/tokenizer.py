"""Tokenizers: byte-level for the presets (offline, any text), `tokenizers` for checkpoints."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path


class Tokenizer(ABC):
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer(Tokenizer):
    """Token i < 256 is byte i; 256 is BOS, 257 EOS; the rest of the vocab decodes to ''."""

    BOS, EOS = 256, 257

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str) -> list[int]:
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

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=True).ids)

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
