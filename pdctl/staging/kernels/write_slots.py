"""The graphs of mapped writes (`page_write.WRITES`): the shape a write is captured
for (`Bucket`) and its tables end to end (`Bucket.tables`), which a replay's slot
holds; a captured write's slot, which also copies the write's sums to its own pinned
host memory unless the write rings a doorbell with them, and the capture of a write
shape's ring of slots. What it does not know: the write itself (the call captured is
`page_write`'s).

A write's arm comes here once (`Bucket.tables`, its segment table made before) and its
replay once (`WriteSlot.hand_out`); `captured` calls nothing else here on the way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdctl.staging.kernels import PendingDigests
from pdctl.staging.kernels.captured import CudaSlot, Eager, capture_slots
from pdctl.staging.settings import StagingSettings


@dataclass(frozen=True)
class Bucket:
    """A write's shape as a graph is captured for it: its segment count and its page
    count rounded up to powers of two (pages past the write's own are never read:
    the kernel stops at each segment's tokens; segments past its own have none), so
    one graph serves every prompt length of the bucket."""

    num_segments: int
    segment_pages: int  # the longest segment's pages (the grid's token blocks)
    num_pages: int
    num_buffers: int

    @staticmethod
    def of(segments: list[tuple[int, int]], num_pages: int, num_buffers: int) -> Bucket:
        longest = max(count for _, count in segments)
        pages = _power_of_two(num_pages)
        if len(segments) == 1:  # one segment: as long as the bucket's pages
            longest = pages
        return Bucket(_power_of_two(len(segments)), longest, pages, num_buffers)

    @property
    def key(self) -> tuple[int, int, int]:
        return self.num_segments, self.segment_pages, self.num_pages

    @property
    def segments(self) -> list[tuple[int, int]]:
        """What the launch is sized by: as many segments, each as long as the longest."""
        return [(0, self.segment_pages)] * self.num_segments

    @property
    def sums(self) -> int:
        return self.num_segments * self.num_buffers

    @staticmethod
    def tables(
        segments: list[tuple[int, int]], num_buffers: int, parts: list[np.ndarray]
    ) -> tuple[Bucket, np.ndarray, list[tuple[int, int]]]:
        """The bucket of a write and its tables end to end as its graph reads them:
        `parts` are the write's segment table (`digests.segment_table`), its page ids,
        the target's, the ring's words; the table and the ids padded with zeros to the
        bucket's (an empty segment; page 0, never read), the ring as it is."""
        bucket = Bucket.of(segments, len(parts[1]), num_buffers)
        pages = bucket.num_pages
        joined, spans = join_tables(parts, [2 * bucket.num_segments, pages, pages, len(parts[3])])
        return bucket, joined, spans


def _power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def join_tables(
    parts: list[np.ndarray], sizes: list[int]
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The int64 arrays end to end, each zero-padded to its size and from an even
    offset (16 bytes, the alignment Triton compiles pointers for), and each one's
    [start, end) (its size)."""
    joined = np.zeros(sum(size + size % 2 for size in sizes), dtype=np.int64)
    spans, offset = [], 0
    for part, size in zip(parts, sizes, strict=True):
        joined[offset : offset + len(part)] = part
        spans.append((offset, offset + size))
        offset += size + size % 2
    return joined, spans


class WriteSlot(CudaSlot):
    """A captured write: the graph also copies the sums to this slot's pinned host
    memory, unless the write rings a doorbell with them (then decode reads them there,
    and this process needs no copy). A replay hands out digests that read it (`last`);
    before the slot is written again, the last ones it handed out are read (so a new
    replay never overwrites sums a caller has yet to see: `CudaSlot.wait`)."""

    def __init__(
        self,
        device: torch.device,
        num_ids: int,
        eager: Eager,
        pool: Any,
        sums: int,
        settings: StagingSettings,
    ) -> None:
        self.host = torch.empty(sums, dtype=torch.int64, pin_memory=True)
        super().__init__(device, num_ids, eager, pool, settings)

    def body(self, eager: Eager, device_ids: torch.Tensor) -> Any:
        pending = eager(device_ids)
        assert pending.sums is not None
        if not pending.rung:
            self.host.copy_(pending.sums, non_blocking=True)
        return pending

    hands_out = True

    def hand_out(self, words: list[int]) -> PendingDigests:
        """A replay's value: the digests of the sums it leaves, for the write's own
        segments' `words` (its arm's `given`)."""
        captured = self.value
        sums, num_buffers = captured.sums, captured.num_buffers
        if captured.rung:  # told by the doorbell: the sums stay on the device (result()
            # reads them there, valid until this slot's next replay; nobody here asks)
            self.last = None
            return PendingDigests(sums, words, num_buffers, rung=True)
        self.last = PendingDigests(sums, words, num_buffers, host=self.host, copied=self.done)
        return self.last


def capture_writes(
    device: torch.device,
    num_ids: int,
    eager: Eager,
    first: PendingDigests | int,
    settings: StagingSettings,
) -> list[Any]:
    """The slots of a write shape (`first`: the sums its writes give, or an eager
    write's digests, whose sums say it)."""
    if isinstance(first, int):
        sums = first
    else:
        assert first.sums is not None
        sums = first.sums.numel()
    return capture_slots(
        device, lambda pool: WriteSlot(device, num_ids, eager, pool, sums, settings)
    )
