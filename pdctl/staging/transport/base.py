"""The transport contract: write byte ranges into a peer's registered memory.

Ownership and reuse:
- The caller owns every buffer. A buffer must stay allocated from `register` until
  `deregister`; the transport never frees memory it did not allocate.
- A write's source bytes may be changed or freed only after the write completed:
  `write` returned, or the handle of `write_async` reported done (`wait` returned or
  `done()` is True). Until then the transport may still read them.
- The destination bytes are the peer's: the peer must not read a range before the
  notification sent with the write that fills it arrives. Notifications are
  delivered after every byte of their write is in the peer's memory; completion
  does not wait for the peer to read the notification.
- Completion means the bytes are in the peer's memory (not merely sent).
- A notification may be given as a function that makes its bytes: it is called
  once, before the notification goes and no later than the bytes landing. The
  builtin transport calls it after its same-host copy, so work the notification
  needs (digests of the pages being written) runs beside the copy.

Mapped writes: where a transport reaches a peer's device memory through a mapping
in this process (same-host device IPC), `mapped_view` gives that memory as a tensor
here, so a kernel can write it directly (with its digests in the same pass); the
caller then sends `notify`, which, like a write's notification, travels after the
bytes (the caller has synchronized the kernel first). Transports without mappings
return None and the caller writes through `write`.

Every wait is bounded by the configured timeouts: a dead, unreachable or stalled
peer raises a `TransportError` naming the peer, never hangs. Nothing received from
the network is unpickled: descriptions are JSON, frames are fixed binary headers.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from pdctl.staging.descriptors import tensor_ptr
from pdctl.staging.transport.regions import MemoryRegion, RegionIndex, outside
from pdctl.staging.transport.values import (
    MAX_NOTIFICATION_BYTES,
    BadDescriptor,
    Descriptors,
    Located,
    Notice,
    Notification,
    Peer,
    PeerUnreachable,
    RegistrationError,
    TransferHandle,
    TransferTimeout,
    TransportConfig,
    TransportError,
    check_descriptors,
    notice_bytes,
)

__all__ = [  # the contract's names, those of `values` re-exported
    "MAX_NOTIFICATION_BYTES",
    "BadDescriptor",
    "Descriptors",
    "Located",
    "MemoryRegion",
    "Notice",
    "Notification",
    "Peer",
    "PeerUnreachable",
    "RegionIndex",
    "RegistrationError",
    "TransferHandle",
    "TransferTimeout",
    "Transport",
    "TransportConfig",
    "TransportError",
    "check_descriptors",
    "notice_bytes",
]


@dataclass(frozen=True)
class KVLayout:
    """The KV buffers an endpoint registered for direct page writes."""

    page_size: int
    num_layers: int
    slot_layer_ids: list[int] | None  # buffer slot -> model layer (pipeline parallelism)


class Transport(ABC):
    """One endpoint of a KV transport. Thread-safe: writes may come from many threads."""

    name: ClassVar[str]
    # Whether a same-host peer may be told through a doorbell (`staging.doorbell`)
    # instead of this transport's notification. pdctl's own transport: yes; the
    # libraries keep their own notifications, so their figures stay theirs.
    RINGS_BELLS: ClassVar[bool] = False

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self.regions: list[MemoryRegion] = []
        self.tensors: dict[int, torch.Tensor] = {}  # region ptr -> tensor, for device memory
        self.kv_layout: KVLayout | None = None  # set by `set_kv_buffer_tensors`
        self._lock = threading.RLock()
        self._notifications: deque[Notification] = deque()
        self._notified = threading.Condition(self._lock)
        self._closed = False
        self._index: RegionIndex | None = None  # rebuilt after (de)registration
        self._tls = threading.local()  # per writing thread: this call's region lookups

    # -- memory --------------------------------------------------------------
    def register(
        self, ptr: int, length: int, *, device_type: str = "cpu", device_index: int | None = None
    ) -> MemoryRegion:
        if length <= 0:
            raise RegistrationError(f"{self.config.name}: cannot register {length} bytes")
        region = MemoryRegion(ptr, length, device_type, device_index)
        self._register(region)
        with self._lock:
            self.regions.append(region)
            self._index = None
        return region

    def register_tensor(self, tensor: torch.Tensor) -> MemoryRegion:
        if not tensor.is_contiguous():
            raise RegistrationError(
                f"{self.config.name}: only contiguous tensors can be registered"
            )
        device = tensor.device
        region = self.register(
            tensor_ptr(tensor),
            tensor.numel() * tensor.element_size(),
            device_type=device.type,
            device_index=device.index,
        )
        with self._lock:
            self.tensors[region.ptr] = tensor.view(-1).view(torch.uint8)
        return region

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            if region not in self.regions:
                raise RegistrationError(
                    f"{self.config.name}: region at {region.ptr:#x} is not registered"
                )
            self.regions.remove(region)
            self.tensors.pop(region.ptr, None)
            self._index = None
        self._deregister(region)

    def set_kv_buffer_tensors(
        self,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        page_size: int,
        *,
        slot_layer_ids: Sequence[int] | None = None,
    ) -> list[MemoryRegion]:
        """Register every layer's K and V buffer for direct page writes.

        `slot_layer_ids` maps buffer slots to model layers under pipeline
        parallelism; it is stored (every transport accepts it) and not read while
        pipeline parallelism is 1.
        """
        regions = [
            self.register_tensor(t) for pair in zip(k_buffers, v_buffers, strict=True) for t in pair
        ]
        layer_ids = list(slot_layer_ids) if slot_layer_ids is not None else None
        self.kv_layout = KVLayout(page_size, len(k_buffers), layer_ids)
        return regions

    @property
    def index(self) -> RegionIndex:
        """This endpoint's registered regions for range lookups (current)."""
        with self._lock:
            if self._index is None:
                self._index = RegionIndex(self.regions)
            return self._index

    # -- description -----------------------------------------------------------
    def describe(self) -> bytes:
        """This endpoint as bytes for a peer (JSON): how to reach it, what it registered."""
        with self._lock:
            regions = [region.to_json() for region in self.regions]
        payload: dict[str, object] = {
            "transport": self.name,
            "version": 1,
            "name": self.config.name,
            "regions": regions,
        }
        payload.update(self._describe())
        return json.dumps(payload).encode()

    def connect(self, description: bytes) -> Peer:
        """Parse a peer's description and make (or refresh) the connection to it."""
        try:
            info = json.loads(description)
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
            if info.get("transport") != self.name:
                raise ValueError(
                    f"it is a {info.get('transport')!r} description, not {self.name!r}"
                )
            regions = [MemoryRegion.from_json(item) for item in info.get("regions", [])]
            name = str(info["name"])
        except (ValueError, KeyError, TypeError) as exc:
            raise PeerUnreachable(f"{self.config.name}: bad peer description: {exc}") from None
        return self._connect(name, regions, info)

    # -- writes ----------------------------------------------------------------
    def write_async(
        self,
        peer: Peer,
        src: Sequence[int] | np.ndarray,
        dst: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        *,
        notify: Notice = None,
    ) -> TransferHandle:
        """Start a write; the handle reports completion (see the module docstring)."""
        try:
            descriptors = self._checked(peer, src, dst, lengths, notify)
            return self._write_async(peer, descriptors, notify)
        finally:
            self._tls.located = None  # the write runs on another thread: it looks again

    def write(
        self,
        peer: Peer,
        src: Sequence[int] | np.ndarray,
        dst: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        *,
        notify: Notice = None,
    ) -> None:
        """Write and return once complete, or raise within the transfer timeout."""
        try:
            descriptors = self._checked(peer, src, dst, lengths, notify)
            self._write_sync(peer, descriptors, notify)
        finally:
            self._tls.located = None  # the lookups served this call only

    def mapped_view(self, peer: Peer, address: int) -> torch.Tensor | None:
        """The peer's registered device memory from `address` to the end of its region,
        as a uint8 tensor of this process, where this transport maps it (see the module
        docstring); None where it does not. Valid while the peer stays connected."""
        return None

    def notify(self, peer: Peer, notice: bytes) -> None:
        """Send a notification alone, after bytes written through `mapped_view`."""
        raise TransportError(f"{self.config.name}: maps no peer memory, so writes carry notices")

    def _checked(
        self,
        peer: Peer,
        src: Sequence[int] | np.ndarray,
        dst: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        notify: Notice,
    ) -> Descriptors:
        if self._closed:
            raise TransportError(f"{self.config.name}: the transport is closed")
        src_a, dst_a, len_a = check_descriptors(src, dst, lengths)
        mine, theirs = self.index, peer.index
        found_src, found_dst = mine.locate(src_a, len_a), theirs.locate(dst_a, len_a)
        bad = outside(found_src)
        if bad is not None:
            raise BadDescriptor(
                f"{self.config.name}: source [{int(src_a[bad]):#x}, +{int(len_a[bad])}) of "
                f"descriptor {bad} is not in registered memory"
            )
        bad = outside(found_dst)
        if bad is not None:
            raise BadDescriptor(
                f"{self.config.name}: destination [{int(dst_a[bad]):#x}, +{int(len_a[bad])}) of "
                f"descriptor {bad} is outside the memory {peer.label} registered"
            )
        if isinstance(notify, bytes) and len(notify) > MAX_NOTIFICATION_BYTES:
            raise BadDescriptor(f"a notification is at most {MAX_NOTIFICATION_BYTES} bytes")
        self._tls.located = Located(src_a, dst_a, peer, mine, found_src, theirs, found_dst)
        return src_a, dst_a, len_a

    def located(self, peer: Peer, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> Located:
        """The region of every source and destination range: the lookups `_checked` made
        for this very call on this thread (thousands of page descriptors cost more to
        look up than to copy), else fresh ones. Use the indexes it carries: a
        registration since then rebuilds `self.index`."""
        cached: Located | None = getattr(self._tls, "located", None)
        if cached is not None and cached.src is src and cached.dst is dst and cached.peer is peer:
            return cached
        mine, theirs = self.index, peer.index
        return Located(
            src, dst, peer, mine, mine.locate(src, lengths), theirs, theirs.locate(dst, lengths)
        )

    def _write_sync(self, peer: Peer, descriptors: Descriptors, notify: Notice) -> None:
        """Default: asynchronous write plus a bounded wait. Transports may do better."""
        handle = self._write_async(peer, descriptors, notify)
        try:
            handle.wait(self.config.transfer_timeout_s)
        except TransferTimeout:
            raise TransferTimeout(
                f"{self.config.name}: write to {peer.label} did not complete within "
                f"{self.config.transfer_timeout_s:g} s"
            ) from None

    # -- notifications -----------------------------------------------------------
    def deliver(self, notification: Notification) -> None:
        """Called by implementations when a notification arrives."""
        with self._notified:
            self._notifications.append(notification)
            self._notified.notify_all()

    def take_notification(self, message: bytes, *, prefix: bool = False) -> Notification | None:
        """The queued notification with this message (or starting with it), taken out;
        None at once when there is none."""
        self._poll()
        with self._notified:
            return self._take(message, prefix)

    def _take(self, message: bytes, prefix: bool) -> Notification | None:
        for item in self._notifications:
            if item.message == message or (prefix and item.message.startswith(message)):
                self._notifications.remove(item)
                return item
        return None

    def wait_notification(
        self, message: bytes, timeout: float | None = None, *, prefix: bool = False
    ) -> Notification:
        """Wait for a notification with this message (or starting with it); others stay queued."""
        limit = self.config.transfer_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self._poll()
            with self._notified:
                found = self._take(message, prefix)
                if found is not None:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(
                        f"{self.config.name}: no notification {message[:64]!r} within {limit:g} s"
                    )
                self._notified.wait(min(remaining, self._poll_interval))

    _poll_interval = 0.005

    def _poll(self) -> None:  # noqa: B027 (optional hook)
        """Pull notifications from the library (transports that do not push them)."""

    # -- lifecycle ---------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for region in list(self.regions):
            with contextlib.suppress(TransportError):
                self.deregister(region)
        self._close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- implementation hooks --------------------------------------------------------
    @abstractmethod
    def _register(self, region: MemoryRegion) -> None: ...

    @abstractmethod
    def _deregister(self, region: MemoryRegion) -> None: ...

    @abstractmethod
    def _describe(self) -> Mapping[str, object]:
        """How a peer reaches this endpoint (its own keys, added to `describe`'s)."""

    @abstractmethod
    def _connect(self, name: str, regions: list[MemoryRegion], info: dict[str, Any]) -> Peer: ...

    @abstractmethod
    def _write_async(self, peer: Peer, descriptors: Descriptors, notify: Notice) -> TransferHandle:
        """Start the checked write. A notification given as a function is made with
        `notice_bytes` no later than the bytes land, before it goes."""

    @abstractmethod
    def _close(self) -> None: ...
