"""A direct room's write to one decode rank: the pages straight into decode's pool.

Two ways (`writes.KvWrite`). `DescribedWrite` writes by descriptors, one per run of
pages consecutive on both sides, the page digests read in place beside the write
(`describe`: one launch on a GPU). `DirectWrite` is the mapped write (`mapped_write`:
the pages and their digests in one launch) where the transport maps decode's pool
here, else `DescribedWrite`. Decode is told by the write's notice (`notice`): its
doorbell where it offered one and its box opens here (after a mapped write the device
rang it behind the pages; after a write by descriptors the host rings it), else the
transport's notification with the digests. Faults wrap these ways (`write_faults`);
they know none.

What this does not know: rooms' registrations' arrival, or other decode ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd.bells import Ringers
from pdctl.serve.pd.mapped_write import MappedWriter
from pdctl.serve.pd.notice import Notice, notice_for
from pdctl.serve.pd.writes import KvWrite, Link, RoomWrite, SendClock, Written
from pdctl.staging.descriptors import KVRows, direct_descriptors, kv_bases
from pdctl.staging.kernels import start_slice_digests
from pdctl.staging.layout import plan_segments


@dataclass(frozen=True)
class Described:
    """A write by descriptors, its digests under way: what to copy, how to tell decode."""

    copies: tuple[np.ndarray, np.ndarray, np.ndarray]  # src, dst, lengths
    nbytes: int
    digests: Callable[[], list[int]]  # waits for the page digests
    notice: Notice


class DescribedWrite(KvWrite):
    """The pages by descriptors, decode told by the write's notice."""

    def __init__(self, rank: int, kv: KVPool, ringers: Ringers) -> None:
        self.rank, self.kv, self.ringers = rank, kv, ringers
        self.kv_bases = kv_bases(kv.k_buffers, kv.v_buffers)  # [L0.K, L0.V, ...]

    def write(self, target: RoomWrite, link: Link, clock: SendClock) -> Written:
        found = self.describe(target, clock)
        found.notice.with_write(link, found.copies, found.digests, found.nbytes)
        return Written(found.nbytes)

    def describe(self, target: RoomWrite, clock: SendClock) -> Described:
        """The write's descriptors, its page digests started (read in place: one launch
        on a GPU, beside the write)."""
        pages, reg, page_size = target.pages, target.reg, self.kv.page_size
        piece = target.layout.slices[target.writer]
        rows = KVRows(
            page_size=page_size,
            head_bytes=reg.head_dim * reg.elem_bytes,
            src_heads=self.kv.k_buffers[0].shape[1],
            dst_heads=reg.kv_heads,
            piece=piece,
        )
        theirs = [address for pair in reg.kv_bases for address in pair]
        copies = direct_descriptors(self.kv_bases, theirs, pages, reg.pages, rows)
        plan = plan_segments(
            len(pages), page_size, target.layout.bytes_per_token(), reg.segment_bytes
        )
        kv, source = self.kv, piece.source(page_size)
        started = time.perf_counter()
        segments = [(segment.page_start, segment.num_pages) for segment in plan]
        pending = start_slice_digests(kv.k_buffers, kv.v_buffers, pages, segments, source)
        clock.digest += time.perf_counter() - started

        def digests() -> list[int]:
            waited = time.perf_counter()
            found = [d for part in pending.result() for d in part]
            clock.digest += time.perf_counter() - waited
            return found

        notice = notice_for(self.ringers, target, self.rank)
        return Described(copies, int(copies[2].sum()), digests, notice)


class DirectWrite(KvWrite):
    """The mapped write where decode's pool is mapped here, else by descriptors."""

    def __init__(self, mapped: MappedWriter, described: DescribedWrite) -> None:
        self.mapped, self.described = mapped, described

    def write(self, target: RoomWrite, link: Link, clock: SendClock) -> Written:
        started = link.launch(lambda: self.mapped.start(target))
        if started is None:
            return self.described.write(target, link, clock)
        self.mapped.finish(started)
        return Written(started.nbytes)
