"""The kernel-backend contract and its lazy registry.

A backend copies column ranges of KV rows between a set of 2-D buffers and a
contiguous staging tensor. The checked wrappers in `kernels/__init__.py` validate
every argument and hand backends normalised views only, the KV side as `KVColumns`:

    buffers[i]   [pool_tokens, row_words]   integer view of one layer's K or V
    staging      [num_buffers, num_tokens, num_cols]   contiguous, same dtype
    pages        [num_pages] int64 on the buffers' device
    row of token t = pages[t // page_size] * page_size + t % page_size

Copies are bit-exact (integer views, never float arithmetic). A backend returns
when the copy is enqueued on the current stream of the device; ordering against
other streams is the caller's job (see `handler.py`).
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

T = TypeVar("T")


_KEEPING = threading.local()


@contextmanager
def keeping() -> Iterator[list[object]]:
    """Every value a BufferCache hands out on this thread meanwhile, kept in the list:
    a CUDA graph captured meanwhile holds their device addresses (pointer tables), so
    whoever keeps the graph keeps the list, and a cache's eviction frees nothing the
    graph still reads."""
    kept: list[object] = []
    previous = getattr(_KEEPING, "kept", None)
    _KEEPING.kept = kept
    try:
        yield kept
    finally:
        _KEEPING.kept = previous


class BufferCache(Generic[T]):
    """Per-buffer-list values computed once (pointer tables, fused views).

    The wrappers hand a backend the same cached list object for a KV set, so the
    list's identity is a cheap, exact key; each entry keeps the list alive, so its
    id cannot be reused while the entry exists.
    """

    def __init__(self, build: Callable[[Sequence[torch.Tensor]], T], size: int = 64) -> None:
        self._build = build
        self._size = size
        self._entries: OrderedDict[int, tuple[Sequence[torch.Tensor], T]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, buffers: Sequence[torch.Tensor]) -> T:
        value = self._get(buffers)
        kept = getattr(_KEEPING, "kept", None)
        if kept is not None:
            kept.append(value)
        return value

    def _get(self, buffers: Sequence[torch.Tensor]) -> T:
        key = id(buffers)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is buffers:
                self._entries.move_to_end(key)
                return entry[1]
        value = self._build(buffers)
        with self._lock:
            self._entries[key] = (buffers, value)
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return value


@dataclass(frozen=True)
class KVColumns:
    """The KV side of a backend's copy: in every buffer, the token rows of `pages`, from
    word `col_start` on (as many words as the staging tensor's last dimension)."""

    buffers: Sequence[torch.Tensor]  # [pool_tokens, row_words] integer views, staging order
    pages: torch.Tensor  # [num_pages] int64 on the buffers' device
    page_size: int
    col_start: int


class KernelBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def gather(self, kv: KVColumns, staging: torch.Tensor) -> None:
        """staging[i, t, :] = buffers[i][row(t), col_start : col_start + num_cols]."""

    @abstractmethod
    def scatter(self, staging: torch.Tensor, kv: KVColumns) -> None:
        """buffers[i][row(t), col_start : col_start + num_cols] = staging[i, t, :]."""


_REGISTRY = {
    "torch": "pdctl.staging.kernels.reference:TorchKernels",
    "triton": "pdctl.staging.kernels.triton:TritonKernels",
}
_INSTANCES: dict[str, KernelBackend] = {}


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> KernelBackend:
    """The named backend; importing Triton happens only when it is asked for."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(backend_names())}")
    if name not in _INSTANCES:
        module, _, attr = _REGISTRY[name].partition(":")
        _INSTANCES[name] = getattr(importlib.import_module(module), attr)()
    return _INSTANCES[name]


def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def default_backend(device: torch.device) -> str:
    """Triton on CUDA and XPU when it imports; the torch path everywhere else."""
    if device.type in ("cuda", "xpu") and triton_importable():
        return "triton"
    return "torch"
