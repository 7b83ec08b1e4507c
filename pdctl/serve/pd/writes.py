"""How a room's KV goes to one decode rank: one small interface, three ways.

`KvWrite.write` writes one prefill rank's share of a room (`RoomWrite`) to one decode
rank and tells decode. The ways:
- staged (`staged.StagedWrite`): per segment, the head slice gathered into a staging
  buffer and written into the ring region decode offered, the notification riding it;
- by descriptors (`direct.DescribedWrite`): the pages straight into decode's pool;
- mapped (`direct.DirectWrite` over `mapped_write`): one launch writes and digests the
  pages where the transport maps decode's pool here, else by descriptors.
The sender keeps them by registration mode (`Ways`), built once. Every byte a way
writes and every launch goes through the `Link` it is given: a fault wraps the link
or the way (`write_faults`), and the ways know no faults.

What this does not know: rooms' registrations' arrival, reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from pdctl.serve.pd import protocol as proto
from pdctl.staging.buffer import StagingBuffer
from pdctl.staging.layout import StagingLayout
from pdctl.staging.transport import Peer, Transport

T = TypeVar("T")
Addresses = Sequence[int] | np.ndarray
Notification = bytes | Callable[[], bytes] | None  # made when the transport sends it


@dataclass
class SendClock:
    """Seconds of one room's send spent gathering and taking digests (the rest of
    write_ms is the transport's writes)."""

    gather: float = 0.0
    digest: float = 0.0


@dataclass(frozen=True)
class RoomWrite:
    """One prefill rank's write of a room to one decode rank: the room's pages,
    decode's registration, the layout of its slices, this rank's writer index in it,
    and decode's endpoint (what every way is given)."""

    room: int
    pages: list[int]
    reg: proto.Registration
    layout: StagingLayout
    writer: int
    peer: Peer


@dataclass(frozen=True)
class Written:
    """What one write did: its bytes, its staged segments (0: a direct write), and the
    seconds it waited for decode's ring regions (not counted as write time)."""

    nbytes: int
    segments: int = 0
    waited_s: float = 0.0


class Link:
    """Decode's endpoint and the transport to it, for one write."""

    def __init__(self, transport: Transport, peer: Peer) -> None:
        self.transport, self.peer = transport, peer

    def write(
        self, src: Addresses, dst: Addresses, lengths: Addresses, notify: Notification = None
    ) -> None:
        """Copies by descriptors (`Transport.write`), the notification riding them."""
        self.transport.write(self.peer, src, dst, lengths, notify=notify)

    def put(self, buffer: StagingBuffer, nbytes: int, address: int, notify: bytes) -> None:
        """A staged segment's block: the buffer's first `nbytes` to `address`."""
        self.write([buffer.ptr], [address], [nbytes], notify)

    def launch(self, start: Callable[[], T]) -> T:
        """A write the device does itself (the mapped write): `start` launches it."""
        return start()

    def notify(self, notice: bytes) -> None:
        """A notification alone, after bytes the device wrote."""
        self.transport.notify(self.peer, notice)


class KvWrite(ABC):
    """One way of writing a room's KV to one decode rank.

    `write` returns once the bytes are in decode's memory and decode was told, or
    raises (`waits.SendFailed`, `TransportError`); `clock` gathers its seconds of
    gathers and digests. Rooms' threads call it at once."""

    @abstractmethod
    def write(self, target: RoomWrite, link: Link, clock: SendClock) -> Written: ...


Ways = Mapping[str, KvWrite]  # a registration's mode ("staging", "direct") -> its way
