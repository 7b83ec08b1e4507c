"""Prefill's `corrupt-kv` fault as a wrapper around a room's writes.

A room's faults are drawn once (`faults.RoomFaults`); the sender then writes the room
through `RoomWrites`: `PLAIN` changes nothing, `CorruptKV` flips one byte of the
room's KV after its digests were taken, so decode must find the mismatch. Staged: the
byte in the middle of segment 0's gathered block, before it is written. Direct: by
descriptors (never the mapped write, whose launch digests what it writes), then the
first byte written there overwritten flipped, the notification with it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

from pdctl.serve.pd.direct import Buffer, DirectWriter
from pdctl.serve.pd.mapped_write import RoomWrite
from pdctl.staging.layout import Segment
from pdctl.staging.transport import Peer, Transport

FLIP = 0x5A


class RoomWrites(Protocol):
    def gathered(self, buffer: Any, nbytes: int, segment: int) -> None:
        """A staged segment gathered and digested, not yet written."""

    def direct(
        self, writer: DirectWriter, write: RoomWrite, plan: tuple[Segment, ...], clock: Any
    ) -> int:
        """A direct write to one decode rank (`DirectWriter.write`); its bytes."""
        ...


class PlainWrites:
    """No fault: the writes as they are."""

    def gathered(self, buffer: Any, nbytes: int, segment: int) -> None:
        pass

    def direct(
        self, writer: DirectWriter, write: RoomWrite, plan: tuple[Segment, ...], clock: Any
    ) -> int:
        return writer.write(write, plan, clock)


PLAIN = PlainWrites()


class CorruptKV:
    """corrupt-kv: one byte of the room's KV flipped after its digests."""

    def gathered(self, buffer: Any, nbytes: int, segment: int) -> None:
        if segment == 0:
            buffer.view(0, nbytes)[nbytes // 2] ^= FLIP

    def direct(
        self, writer: DirectWriter, write: RoomWrite, plan: tuple[Segment, ...], clock: Any
    ) -> int:
        found = writer.describe(write, plan, clock)
        writer.transport.write(write.peer, found.src, found.dst, found.lengths)
        _overwrite_flipped(
            writer.transport,
            writer.buffer,
            write.peer,
            int(found.src[0]),
            int(found.dst[0]),
            found.message(),
        )
        return found.nbytes


def _overwrite_flipped(
    transport: Transport, buffer: Buffer, peer: Peer, src: int, dst: int, notify: bytes
) -> None:
    """Overwrite the byte at `dst` with the byte at `src` (just sent there) flipped."""
    sent = ctypes.c_uint8.from_address(src).value
    with buffer() as staging:
        staging.view(0, 1)[0] = sent ^ FLIP
        transport.write(peer, [staging.ptr], [dst], [1], notify=notify)
