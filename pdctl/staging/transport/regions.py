"""Registered memory regions and the lookup of many ranges in them at once.

`MemoryRegion` is one registration as both ends describe it; `RegionIndex` answers,
for thousands of ranges in one numpy pass, which region holds each (a direct page
write carries one range per page and layer); `outside` names the first range no
region holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SMALL_LOOKUP = 8  # up to this many ranges, region lookups run in Python ints


@dataclass(frozen=True)
class MemoryRegion:
    ptr: int
    length: int
    device_type: str = "cpu"
    device_index: int | None = None

    def contains(self, ptr: int, length: int) -> bool:
        return self.ptr <= ptr and ptr + length <= self.ptr + self.length

    def to_json(self) -> list[Any]:
        return [self.ptr, self.length, self.device_type, self.device_index]

    @staticmethod
    def from_json(item: Any) -> MemoryRegion:
        ptr, length, device_type, index = item
        return MemoryRegion(int(ptr), int(length), str(device_type), index)


class RegionIndex:
    """Which region holds each of many ranges, at once (numpy; no loop per range).

    A write carries up to thousands of descriptors (one per KV page and layer) and
    a pool registers one region per layer buffer: looking each range up in Python
    costs more than moving a 4 KiB page. Regions are sorted by start; a range
    belongs to the last region starting at or before it if it ends inside it.
    Overlapping registrations (a view registered beside its allocation) fall back
    to a scan for the ranges the sorted lookup misses.
    """

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        self.regions = list(regions)
        order = sorted(range(len(self.regions)), key=lambda i: self.regions[i].ptr)
        self._order = np.array(order, dtype=np.int64)
        self._starts = np.array([self.regions[i].ptr for i in order], dtype=np.uint64)
        self._ends = self._starts + np.array(
            [self.regions[i].length for i in order], dtype=np.uint64
        )
        self._overlap = bool(len(order) > 1 and (self._ends[:-1] > self._starts[1:]).any())
        self._lists = (self._starts.tolist(), self._ends.tolist(), order)  # for a few ranges

    def locate(self, ptrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Index into `regions` of the region holding each range, -1 where none does."""
        if not self.regions:
            return np.full(len(ptrs), -1, dtype=np.int64)
        if len(ptrs) <= SMALL_LOOKUP:
            return self._locate_few(ptrs, lengths)
        at = np.searchsorted(self._starts, ptrs, side="right").astype(np.int64) - 1
        clipped = np.maximum(at, 0)
        ends = self._ends[clipped]
        inside = (at >= 0) & (ptrs <= ends) & (lengths <= ends - ptrs)  # no u64 overflow
        found = np.where(inside, self._order[clipped], -1)
        if self._overlap:
            for index in np.flatnonzero(found < 0).tolist():
                ptr, length = int(ptrs[index]), int(lengths[index])
                found[index] = self._scan(ptr, length)
        return found

    def _locate_few(self, ptrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The same for a handful of ranges, in Python ints (numpy's per-call cost dominates)."""
        starts, ends, order = self._lists
        found = []
        for ptr, length in zip(ptrs.tolist(), lengths.tolist(), strict=True):
            at = bisect.bisect_right(starts, ptr) - 1
            if at >= 0 and ptr + length <= ends[at]:
                found.append(order[at])
            else:
                found.append(self._scan(ptr, length) if self._overlap else -1)
        return np.array(found, dtype=np.int64)

    def _scan(self, ptr: int, length: int) -> int:
        return next((i for i, r in enumerate(self.regions) if r.contains(ptr, length)), -1)


def outside(found: np.ndarray) -> int | None:
    """Index of the first range no region holds (`RegionIndex.locate`), or None."""
    if found.min() >= 0:
        return None
    return int(np.flatnonzero(found < 0)[0])
