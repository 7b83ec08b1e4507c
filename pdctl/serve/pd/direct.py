"""A direct room's write to one decode rank: the pages straight into decode's pool.

Where the transport maps decode's pool here, the mapped write (`mapped_write`: the
pages and their digests in one launch); elsewhere descriptors, one per run of pages
consecutive on both sides, and the page digests read in place beside the write
(`describe`). Decode is told by its doorbell where it offered one and its box opens
here (after a mapped write the device rang it behind the pages; after a write by
descriptors the host rings it, `bells`), else by the transport's notification with
the digests. Faults wrap this writer (`corrupt_kv`); it knows none.

What this does not know: rooms' registrations' arrival, or other decode ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.mapped_write import MappedWriter, RoomWrite
from pdctl.staging.descriptors import KVRows, direct_descriptors, kv_bases
from pdctl.staging.doorbell import DIGESTS, BellRinger, Ticket
from pdctl.staging.kernels import start_page_digests
from pdctl.staging.layout import Segment

Buffer = Callable[[], AbstractContextManager[Any]]  # a staging buffer, held for one write


@dataclass(frozen=True)
class Described:
    """A write by descriptors, its digests under way: what to copy, what to tell."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    nbytes: int
    digests: Callable[[], list[int]]  # waits for the page digests
    message: Callable[[], bytes]  # the notification, with them
    bell: tuple[BellRinger, Ticket] | None  # decode's doorbell, where it opens here


class DirectWriter:
    def __init__(self, mapped: MappedWriter, buffer: Buffer) -> None:
        self.mapped, self.buffer = mapped, buffer  # the rank, pool and transport are its
        self.rank, self.kv, self.transport = mapped.rank, mapped.kv, mapped.transport
        self.kv_bases = kv_bases(self.kv.k_buffers, self.kv.v_buffers)  # [L0.K, L0.V, ...]

    def write(self, write: RoomWrite, plan: tuple[Segment, ...], clock: Any) -> int:
        """Write and tell decode; returns the bytes written. `clock.digest` gathers the
        seconds spent on digests."""
        mapped = self.mapped.start(write)
        if mapped is not None:
            self.mapped.finish(mapped)
            return mapped.nbytes
        found = self.describe(write, plan, clock)
        if found.bell is not None:  # the bytes are in place once `write` returns: ring
            self.transport.write(write.peer, found.src, found.dst, found.lengths)
            found.bell[0].ring(found.bell[1], DIGESTS, found.digests())
        else:
            self.transport.write(
                write.peer, found.src, found.dst, found.lengths, notify=found.message
            )
        return found.nbytes

    def describe(self, write: RoomWrite, plan: tuple[Segment, ...], clock: Any) -> Described:
        """The write's descriptors, its page digests started (read in place: one launch
        on a GPU, beside the write)."""
        room, pages, reg = write.room, write.pages, write.reg
        piece = write.layout.slices[write.writer]
        src, dst, lengths = direct_descriptors(
            self.kv_bases,
            [address for pair in reg.kv_bases for address in pair],
            pages,
            reg.pages,
            KVRows(
                page_size=self.kv.page_size,
                head_bytes=reg.head_dim * reg.elem_bytes,
                src_heads=self.kv.k_buffers[0].shape[1],
                dst_heads=reg.kv_heads,
                piece=piece,
            ),
        )
        started = time.perf_counter()
        pending = start_page_digests(
            self.kv.k_buffers,
            self.kv.v_buffers,
            pages,
            [(segment.page_start, segment.num_pages) for segment in plan],
            head_start=piece.src_head_start,
            num_heads=piece.num_heads,
            page_size=self.kv.page_size,
        )
        clock.digest += time.perf_counter() - started
        nbytes = int(lengths.sum())

        def digests() -> list[int]:
            waited = time.perf_counter()
            found = [d for part in pending.result() for d in part]
            clock.digest += time.perf_counter() - waited
            return found

        def message() -> bytes:  # made once the copy is done (or before, by other transports)
            return proto.notify_message(room, proto.DIRECT_SEGMENT, self.rank, digests(), nbytes)

        bell = self.mapped.ringers.ticket(reg, write.writer)
        return Described(src, dst, lengths, nbytes, digests, message, bell)
