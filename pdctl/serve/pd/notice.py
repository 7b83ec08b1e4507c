"""How decode learns that one writer's bytes landed: the notice, chosen once per write.

Where decode offered a doorbell and its box opens here (same host, `bells`), the
writer rings its ticket with the digests (`BellNotice`: from the device at the end of
a mapped write's launch, else from the host once the bytes are in place); elsewhere
the transport's notification carries them (`MessageNotice`), riding a write by
descriptors. `notice_for` picks one from a write's registration.

What this does not know: how the bytes were written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.bells import Ringers
from pdctl.serve.pd.writes import Addresses, Link, RoomWrite
from pdctl.staging.doorbell import DIGESTS, BellRinger, Ticket


class Notice(ABC):
    """How decode is told one write landed, with the write's digests."""

    how: ClassVar[str]  # as a write's observer hears it
    # what a mapped write's launch rings at its end (the doorbell slot's device address,
    # the ticket's sequence number); None: the host tells decode
    device_bell: tuple[int, int] | None = None

    @abstractmethod
    def tell(self, link: Link, digests: list[int], nbytes: int) -> None:
        """The bytes are in decode's memory: tell it."""

    def with_write(
        self,
        link: Link,
        copies: tuple[Addresses, Addresses, Addresses],
        digests: Callable[[], list[int]],
        nbytes: int,
    ) -> None:
        """Copies by descriptors (src, dst, lengths), then decode told."""
        link.write(*copies)
        self.tell(link, digests(), nbytes)

    @abstractmethod
    def rung(self) -> None:
        """The launch rang `device_bell`: decode is told already."""


@dataclass(frozen=True)
class BellNotice(Notice):
    how = "doorbell (host)"

    ringer: BellRinger
    ticket: Ticket
    device_bell: tuple[int, int] | None = None

    def tell(self, link: Link, digests: list[int], nbytes: int) -> None:
        self.ringer.ring(self.ticket, DIGESTS, digests)

    def rung(self) -> None:
        self.ringer.announce(self.ticket)  # decode looks closely from now on


@dataclass(frozen=True)
class MessageNotice(Notice):
    how = "notification"

    room: int
    rank: int  # the writer's prefill rank

    def message(self, digests: list[int], nbytes: int) -> bytes:
        return proto.notify_message(self.room, proto.DIRECT_SEGMENT, self.rank, digests, nbytes)

    def tell(self, link: Link, digests: list[int], nbytes: int) -> None:
        link.notify(self.message(digests, nbytes))

    def with_write(
        self,
        link: Link,
        copies: tuple[Addresses, Addresses, Addresses],
        digests: Callable[[], list[int]],
        nbytes: int,
    ) -> None:
        # made once the copy is done (or before, by other transports)
        link.write(*copies, notify=lambda: self.message(digests(), nbytes))

    def rung(self) -> None:
        pass  # no doorbell (`device_bell` is None): never rung


def notice_for(
    ringers: Ringers, write: RoomWrite, rank: int, device: torch.device | None = None
) -> Notice:
    """Writer `write.writer`'s doorbell where decode offered one and its box opens here
    (rung from `device` where a launch there can, given), else the notification from
    prefill rank `rank`."""
    found = ringers.ticket(write.reg, write.writer)
    if found is None:
        return MessageNotice(write.room, rank)
    ringer, ticket = found
    slot = None if device is None else ringer.device_slot(ticket.slot, device)
    return BellNotice(ringer, ticket, None if slot is None else (slot, ticket.seq))
