"""The decode-side staging ring: regions, overcommit and the (round, tail) watermark.

Plain state, no I/O, no torch: the ring hands out byte regions of one buffer of
`capacity` bytes. Positions are logical and only grow; the physical offset is the
position modulo the capacity and the round is the quotient:

    logical:  0 ........ C ........ 2C .......
    round:    0          1          2
    region:   [start, end), never straddling a round boundary (padding skips to 0)

Freed regions advance the watermark `freed_to` past every consecutively freed
region in assignment order. Prefill may write a region only once the bytes it
overlays from the previous round are free:

    writable(region)  <=>  freed_to >= region.end - capacity

With overcommit, a region may be assigned before it is writable (up to
`overcommit_rounds` rounds ahead); prefill then waits on the watermark, which it
reads as `(round, tail)`. When the ring becomes empty the next region starts a
fresh round at offset 0, so an empty ring never waits on a stale watermark.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class RegionTooLarge(ValueError):
    """A request larger than the whole ring: send it in segments instead."""


@dataclass(frozen=True)
class Watermark:
    """Everything before `round * capacity + tail` (logical) has been freed."""

    round: int
    tail: int

    def position(self, capacity: int) -> int:
        return self.round * capacity + self.tail


@dataclass(frozen=True)
class Region:
    start: int  # logical position
    size: int
    capacity: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def offset(self) -> int:
        """Physical byte offset in the ring buffer."""
        return self.start % self.capacity

    @property
    def round(self) -> int:
        return self.start // self.capacity

    def writable(self, watermark: Watermark) -> bool:
        """May prefill write this region, given decode's watermark?"""
        return watermark.position(self.capacity) >= self.end - self.capacity


@dataclass
class _Entry:
    region: Region
    freed: bool = False


class RingAllocator:
    """Assigns and frees regions of one ring buffer (one decode rank)."""

    def __init__(self, capacity: int, *, overcommit_rounds: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"ring capacity must be >= 1 byte, got {capacity}")
        if overcommit_rounds < 0:
            raise ValueError(f"overcommit_rounds must be >= 0, got {overcommit_rounds}")
        self.capacity = capacity
        self.overcommit_rounds = overcommit_rounds
        self._head = 0  # logical position of the next region
        self._freed_to = 0  # watermark
        self._live: deque[_Entry] = deque()  # in assignment order

    @property
    def watermark(self) -> Watermark:
        return Watermark(*divmod(self._freed_to, self.capacity))

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def is_empty(self) -> bool:
        return not self._live

    def assign(self, size: int) -> Region | None:
        """A region of `size` bytes, or None when it would overcommit too far (retry later).

        Raises RegionTooLarge when `size` exceeds the ring: no wait can help.
        """
        if size < 1:
            raise ValueError(f"region size must be >= 1 byte, got {size}")
        if size > self.capacity:
            raise RegionTooLarge(
                f"a region of {size} bytes does not fit a staging ring of {self.capacity} bytes"
            )
        start = self._head
        if self.is_empty and start % self.capacity:
            start += self.capacity - start % self.capacity  # fresh round at offset 0
            self._freed_to = start
        elif start % self.capacity + size > self.capacity:
            start += self.capacity - start % self.capacity  # pad to the next round
        end = start + size
        if end - self._freed_to > self.capacity * (1 + self.overcommit_rounds):
            return None
        region = Region(start, size, self.capacity)
        self._head = end
        self._live.append(_Entry(region))
        return region

    def free(self, region: Region) -> Watermark:
        """Mark `region` freed and advance the watermark; returns the new watermark."""
        for entry in self._live:
            if entry.region == region:
                if entry.freed:
                    raise ValueError(f"region at {region.start} was already freed")
                entry.freed = True
                break
        else:
            raise ValueError(f"region at {region.start} is not live in this ring")
        while self._live and self._live[0].freed:
            self._live.popleft()
        # Padding before the first live region is free too.
        self._freed_to = self._live[0].region.start if self._live else self._head
        return self.watermark

    def live_regions(self) -> list[Region]:
        return [entry.region for entry in self._live if not entry.freed]
