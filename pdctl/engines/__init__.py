"""Engines: turn each server of a topology into ports, environment and a command line.

`get_engine(name)` is the registry; implementations are imported lazily so that an
engine's dependencies are only touched when a topology uses it.
"""

from __future__ import annotations

import importlib

from pdctl.engines.base import Engine

_REGISTRY = {
    "embedded": "pdctl.engines.embedded:EmbeddedEngine",
    "sglang": "pdctl.engines.sglang:SGLangEngine",
    "vllm": "pdctl.engines.vllm:VLLMEngine",
}


def engine_names() -> list[str]:
    return sorted(_REGISTRY)


def get_engine(name: str) -> Engine:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(engine_names())}") from None
    module, _, attr = target.partition(":")
    engine_class: type[Engine] = getattr(importlib.import_module(module), attr)
    return engine_class()


__all__ = ["Engine", "engine_names", "get_engine"]
