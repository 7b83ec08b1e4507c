"""The values the transport contract (`base.Transport`) speaks in: its errors, its
configuration, a notification and a connected peer, an asynchronous write's handle, and
a write's descriptors, checked (`check_descriptors`) and located in registered regions
(`Located`). What it does not know: any transport's implementation."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdctl.staging.descriptors import as_u64
from pdctl.staging.transport.regions import MemoryRegion, RegionIndex

MAX_NOTIFICATION_BYTES = 64 * 1024
# A notification's bytes, or a function that makes them once the write is under way.
Notice = bytes | Callable[[], bytes] | None


class TransportError(RuntimeError):
    """A transfer could not be done; the message names the peer and the reason."""


class PeerUnreachable(TransportError):
    pass


class TransferTimeout(TransportError):
    pass


class RegistrationError(TransportError):
    pass


class BadDescriptor(TransportError, ValueError):
    pass


def notice_bytes(notify: Notice) -> bytes | None:
    """The notification's bytes (calling the function given for them), size-checked."""
    message = notify() if callable(notify) else notify
    if message is not None and len(message) > MAX_NOTIFICATION_BYTES:
        raise BadDescriptor(f"a notification is at most {MAX_NOTIFICATION_BYTES} bytes")
    return message


@dataclass(frozen=True)
class TransportConfig:
    name: str  # this endpoint, as peers and messages call it ("decode-0 rank 1")
    host: str = "127.0.0.1"
    port: int = 0  # listener port where the transport has one; 0 picks a free one
    connect_timeout_s: float = 10.0
    transfer_timeout_s: float = 30.0
    protocol: str | None = None  # mooncake: tcp | rdma (default: MOONCAKE_PROTOCOL or tcp)
    ib_devices: tuple[str, ...] = ()
    nixl_backend: str = "UCX"
    secret: bytes = b""  # per-run secret peers must prove they hold
    same_host_fast_path: bool = True  # tcp: write into same-host peers' memory directly


@dataclass(frozen=True)
class Notification:
    peer: str
    message: bytes


@dataclass
class Peer:
    """A connected remote endpoint; `name` is what errors call it."""

    name: str
    address: str
    regions: list[MemoryRegion]
    state: dict[str, Any] = field(default_factory=dict)  # transport-specific
    _index: RegionIndex | None = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.address})"

    @property
    def index(self) -> RegionIndex:
        """The peer's regions for range lookups (they do not change after connect)."""
        if self._index is None:
            self._index = RegionIndex(self.regions)
        return self._index


class TransferHandle(ABC):
    """Completion of one asynchronous write."""

    @abstractmethod
    def done(self) -> bool:
        """True once complete; raises TransportError if the write failed."""

    def wait(self, timeout: float) -> None:
        """Block until complete, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        delay = 0.0002
        while not self.done():
            if time.monotonic() >= deadline:
                raise TransferTimeout(self.timeout_message(timeout))
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def timeout_message(self, timeout: float) -> str:
        return f"write did not complete within {timeout:g} s"


Descriptors = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Located:
    """One write's ranges and the regions holding them (indexes into `mine.regions`
    and `theirs.regions`)."""

    src: np.ndarray
    dst: np.ndarray
    peer: Peer
    mine: RegionIndex
    sources: np.ndarray
    theirs: RegionIndex
    targets: np.ndarray


def check_descriptors(
    src: Sequence[int] | np.ndarray,
    dst: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
) -> Descriptors:
    """Three equal-length uint64 arrays, or a BadDescriptor saying what is wrong."""
    arrays = []
    for name, values in (("src", src), ("dst", dst), ("lengths", lengths)):
        try:
            arrays.append(as_u64(values))
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadDescriptor(f"{name} must be unsigned 64-bit integers: {exc}") from None
    if not (len(arrays[0]) == len(arrays[1]) == len(arrays[2])):
        raise BadDescriptor(
            f"src, dst and lengths must have one entry per write, got "
            f"{len(arrays[0])}, {len(arrays[1])} and {len(arrays[2])}"
        )
    if len(arrays[0]) == 0:
        raise BadDescriptor("a write needs at least one descriptor")
    if (arrays[2] == 0).any():
        raise BadDescriptor(f"descriptor {int(np.argmin(arrays[2]))} has length 0")
    return arrays[0], arrays[1], arrays[2]
