"""Prefill's faults as wrappers around a room's writes (`writes.KvWrite`).

A room's faults are drawn once (`RoomWays.draw`, `faults.RoomFaults`); its writes are
then its sender's ways as they ask (`RoomWays.enter`). The ways know no faults:
- corrupt-kv flips one byte of the room's KV after its digests were taken, so decode
  must find the mismatch. Staged (`CorruptStaged`): the byte in the middle of segment
  0's gathered block, before it is written. Direct (`CorruptDescribed`): by descriptors
  (never the mapped write, whose launch digests what it writes), then the first byte
  written there overwritten flipped, the notification with it.
- abort-transfer (`LandLate`): decode aborts the room mid-transfer; a write to it waits
  for the room to close, then lands `late_write_s` after (it was in flight). Once the
  room closed no other write of it starts: a staged write looks at the room before
  each segment, the sender before each decode rank.
- delay-transfer: the room is held before its first write, past decode's timeout.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import TypeVar

from pdctl.serve.faults import RoomFaults
from pdctl.serve.pd.direct import DescribedWrite, DirectWrite
from pdctl.serve.pd.notice import MessageNotice
from pdctl.serve.pd.staged import StagedWrite, StagingBuffers
from pdctl.serve.pd.waits import RoomWaits
from pdctl.serve.pd.writes import (
    Addresses,
    KvWrite,
    Link,
    Notification,
    RoomWrite,
    SendClock,
    Ways,
    Written,
)
from pdctl.staging.buffer import StagingBuffer

T = TypeVar("T")
FLIP = 0x5A


class RoomWays:
    """A sender's ways by registration mode, built once (`plain`, and `corrupt` around
    them), and a room's ways as its drawn faults wrap them."""

    def __init__(self, plain: Ways, corrupt: Ways, waits: RoomWaits) -> None:
        self.plain, self.corrupt, self.waits = plain, corrupt, waits

    @staticmethod
    def around(
        staged: StagedWrite, direct: DirectWrite, buffers: StagingBuffers, waits: RoomWaits
    ) -> RoomWays:
        """A room's ways by registration mode, and corrupt-kv's around them."""
        plain: Ways = {"staging": staged, "direct": direct}
        corrupt: Ways = {
            "staging": CorruptStaged(staged),
            "direct": CorruptDescribed(direct.described, buffers),
        }
        return RoomWays(plain, corrupt, waits)

    def draw(self, room: int) -> RoomFaults:
        """The room's faults, drawn once decode registered it."""
        waits = self.waits
        return RoomFaults.for_prefill(
            waits.bootstrap_timeout + waits.transfer_timeout + 2, room=room
        )

    def enter(self, faults: RoomFaults) -> Ways:
        """The room's ways as its faults have them (delay-transfer: after holding it)."""
        if faults.delay_s is not None:  # decode is waiting now; hold the room past it
            time.sleep(faults.delay_s)
        ways = self.corrupt if faults.corrupt_kv else self.plain
        late_s = faults.late_write_s
        if late_s is None:
            return ways
        return {mode: LandLate(way, self.waits, late_s) for mode, way in ways.items()}


class CorruptStaged(KvWrite):
    """corrupt-kv around a staged write: segment 0's block flipped before it goes."""

    def __init__(self, inner: KvWrite) -> None:
        self.inner = inner

    def write(self, target: RoomWrite, link: Link, clock: SendClock) -> Written:
        return self.inner.write(target, _FlipFirstBlock(link), clock)


class CorruptDescribed(KvWrite):
    """corrupt-kv around a direct write: by descriptors, then its first byte flipped."""

    def __init__(self, inner: DescribedWrite, buffers: StagingBuffers) -> None:
        self.inner, self.buffers = inner, buffers

    def write(self, target: RoomWrite, link: Link, clock: SendClock) -> Written:
        found = self.inner.describe(target, clock)
        link.write(*found.copies)
        notice = MessageNotice(target.room, self.inner.rank)
        message = notice.message(found.digests(), found.nbytes)
        src, dst = int(found.copies[0][0]), int(found.copies[1][0])
        sent = ctypes.c_uint8.from_address(src).value  # the byte just sent to `dst`
        with self.buffers.held() as staging:
            staging.view(0, 1)[0] = sent ^ FLIP
            link.write([staging.ptr], [dst], [1], message)
        return Written(found.nbytes)


class LandLate(KvWrite):
    """abort-transfer around a write: it lands `seconds` after the room closed."""

    def __init__(self, inner: KvWrite, waits: RoomWaits, seconds: float) -> None:
        self.inner, self.waits, self.seconds = inner, waits, seconds

    def write(self, target: RoomWrite, link: Link, clock: SendClock) -> Written:
        return self.inner.write(target, _Late(link, lambda: self._land(target.room)), clock)

    def _land(self, room: int) -> None:
        self.waits.closed(room)  # waited for, bounded
        time.sleep(self.seconds)


class _Wrapped(Link):
    """A link that passes everything to `inner` (faults override what they change)."""

    def __init__(self, inner: Link) -> None:
        super().__init__(inner.transport, inner.peer)
        self.inner = inner

    def write(
        self, src: Addresses, dst: Addresses, lengths: Addresses, notify: Notification = None
    ) -> None:
        self.inner.write(src, dst, lengths, notify)

    def put(self, buffer: StagingBuffer, nbytes: int, address: int, notify: bytes) -> None:
        self.inner.put(buffer, nbytes, address, notify)

    def launch(self, start: Callable[[], T]) -> T:
        return self.inner.launch(start)

    def notify(self, notice: bytes) -> None:
        self.inner.notify(notice)


class _FlipFirstBlock(_Wrapped):
    def __init__(self, inner: Link) -> None:
        super().__init__(inner)
        self.flipped = False

    def put(self, buffer: StagingBuffer, nbytes: int, address: int, notify: bytes) -> None:
        if not self.flipped:  # segment 0: after its digests, before it is written
            self.flipped = True
            buffer.view(0, nbytes)[nbytes // 2] ^= FLIP
        self.inner.put(buffer, nbytes, address, notify)


class _Late(_Wrapped):
    """The first write or launch through it lands late (`land` runs first)."""

    def __init__(self, inner: Link, land: Callable[[], None]) -> None:
        super().__init__(inner)
        self.land: Callable[[], None] | None = land

    def _landing(self) -> None:
        land, self.land = self.land, None
        if land is not None:
            land()

    def write(
        self, src: Addresses, dst: Addresses, lengths: Addresses, notify: Notification = None
    ) -> None:
        self._landing()
        self.inner.write(src, dst, lengths, notify)

    def put(self, buffer: StagingBuffer, nbytes: int, address: int, notify: bytes) -> None:
        self._landing()
        self.inner.put(buffer, nbytes, address, notify)

    def launch(self, start: Callable[[], T]) -> T:
        self._landing()
        return self.inner.launch(start)
