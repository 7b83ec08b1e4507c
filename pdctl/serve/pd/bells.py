"""Doorbells in the PD protocol: decode's box and tickets, prefill's ringers.

A direct room between two processes of one host needs no notification message:
decode offers one ticket per writer in its registration (`protocol.BellOffer`), and a
prefill rank that can open decode's box rings its ticket once the room's pages
landed: from the device at the end of the mapped write's launch, or from the host
after a write by descriptors (`staging.doorbell`). A writer that cannot open the box
(another host) notifies as before; decode hears either. The server's `bells`
setting, given to both, turns doorbells off (decode offers none, prefill rings none).

Decode: `Bells.for_receiver` (one box per decode rank, where its transport allows
bells), `offer`, `digests` (a ring's values as the digests a notification carries),
`give_back`. Prefill: `Ringers.open` (each box once; a box that cannot be opened is
remembered and logged once).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.staging import futex
from pdctl.staging.digest import digests_of_sums
from pdctl.staging.doorbell import DIGESTS, SUMS, BellBox, BellRinger, BoxInfo, Ticket
from pdctl.staging.layout import HeadSlice, Segment, StagingLayout
from pdctl.staging.transport import Transport

log = logging.getLogger("pdctl.serve")
SLOTS = 64  # rooms a decode rank receives by doorbell at once (more go by message)
MAX_SEGMENTS = 16  # a room cut into more digest segments goes by message


class Bells:
    """A decode rank's doorbells: its box, the tickets it hands out."""

    def __init__(self, box: BellBox, kv: KVPool) -> None:
        self.box, self.kv = box, kv
        self.num_layers = len(kv.k_buffers)
        self._said_full = False

    @staticmethod
    def for_receiver(
        transport: Transport, kv: KVPool, name: str, *, enabled: bool = True
    ) -> Bells | None:
        if not (enabled and transport.RINGS_BELLS and futex.available()):
            return None
        try:
            box = BellBox(SLOTS, 2 * len(kv.k_buffers) * MAX_SEGMENTS)
        except OSError as exc:
            log.info("%s: no doorbells (%s): prefill notifies by message", name, exc)
            return None
        return Bells(box, kv)

    def offer(self, layout: StagingLayout, num_segments: int) -> proto.BellOffer | None:
        """A ticket for every writer of a direct room (None: the room's values do not fit
        a slot, or too few slots are free: its writers notify by message)."""
        if 2 * self.num_layers * num_segments > self.box.capacity:
            return None
        tickets: list[Ticket] = []
        for _ in layout.slices:
            ticket = self.box.ticket()
            if ticket is None:
                for taken in tickets:
                    self.box.release(taken)
                if not self._said_full:
                    self._said_full = True
                    log.info("every doorbell slot is in use: rooms beyond go by message")
                return None
            tickets.append(ticket)
        return proto.BellOffer(self.box.info, tickets)

    def digests(
        self, kind: int, values: np.ndarray, piece: HeadSlice, plan: tuple[Segment, ...]
    ) -> list[int]:
        """A ring's values as a notification's digests: [segment][L0.K, L0.V, ...] flat.
        Sums are finalised here with each chunk's length in int32 words."""
        if kind == DIGESTS:
            return [int(v) & ((1 << 64) - 1) for v in values]
        if kind != SUMS:
            raise ValueError(f"a doorbell rang with an unknown kind {kind}")
        first = self.kv.k_buffers[0]
        head_bytes = first.shape[2] * first.element_size()
        columns = piece.num_heads * head_bytes // 4  # int32 words of the slice a token
        words = [segment.num_tokens(self.kv.page_size) * columns for segment in plan]
        lengths = np.repeat(np.asarray(words, dtype=np.uint64), 2 * self.num_layers)
        if len(lengths) != len(values):
            raise ValueError(f"a doorbell rang {len(values)} sums for {len(lengths)} chunks")
        return digests_of_sums(values, lengths)

    def give_back(self, offer: proto.BellOffer, read: set[int]) -> None:
        """Tickets whose ring was read go back; the others are given up (a late ring may
        still come: their slots rest before they serve again)."""
        for writer, ticket in enumerate(offer.tickets):
            if writer in read:
                self.box.release(ticket)
            else:
                self.box.quarantine(ticket)


class Ringers:
    """Prefill's ends of decode boxes, each opened once (thread-safe)."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled  # off: every writer notifies by message
        self._open: dict[tuple[str, int], BellRinger | None] = {}
        self._lock = threading.Lock()

    def ticket(self, reg: proto.Registration, writer: int) -> tuple[BellRinger, Ticket] | None:
        """Writer `writer`'s ticket of a registration and the ringer of its box, where
        decode offered one and the box opens here."""
        if reg.bell is None or writer >= len(reg.bell.tickets):
            return None
        ringer = self.open(reg.bell.box)
        return None if ringer is None else (ringer, reg.bell.tickets[writer])

    def open(self, box: BoxInfo) -> BellRinger | None:
        """The ringer of `box`, or None where this process cannot open it (another host,
        another box at that path): the writer notifies by message."""
        if not self.enabled:
            return None
        key = (box.path, box.nonce)
        with self._lock:
            if key in self._open:
                return self._open[key]
            try:
                ringer: BellRinger | None = BellRinger(box)
            except OSError as exc:
                log.info("decode's doorbell box %s cannot be opened here (%s)", box.path, exc)
                ringer = None
            self._open[key] = ringer
            return ringer
