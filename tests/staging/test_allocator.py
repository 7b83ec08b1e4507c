"""The decode staging ring: unit cases and a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdctl.staging.allocator import Region, RegionTooLarge, RingAllocator, Watermark


def test_regions_fill_then_pad_to_the_next_round() -> None:
    ring = RingAllocator(100, overcommit_rounds=0)
    a, b = ring.assign(40), ring.assign(40)
    assert (a.offset, b.offset) == (0, 40)
    assert ring.assign(40) is None  # would overwrite a, not yet free, no overcommit
    ring.free(a)
    c = ring.assign(40)  # 80 + 40 > 100: padded to the next round, offset 0
    assert c is not None and (c.offset, c.round) == (0, 1)
    assert c.writable(ring.watermark)


def test_oversized_region_fails_clearly() -> None:
    ring = RingAllocator(64)
    with pytest.raises(RegionTooLarge, match="65 bytes does not fit a staging ring of 64 bytes"):
        ring.assign(65)


def test_overcommitted_region_waits_for_the_watermark() -> None:
    ring = RingAllocator(100, overcommit_rounds=1)
    a = ring.assign(60)
    b = ring.assign(60)  # next round, overlays a's bytes
    assert b is not None and b.offset == 0 and b.round == 1
    assert not b.writable(ring.watermark)
    watermark = ring.free(a)
    assert watermark == Watermark(1, 0) and b.writable(watermark)


def test_out_of_order_frees_advance_only_past_consecutive_regions() -> None:
    ring = RingAllocator(100)
    a, b, c = ring.assign(10), ring.assign(10), ring.assign(10)
    assert ring.free(b) == Watermark(0, 0)
    assert ring.free(a) == Watermark(0, 20)
    assert ring.free(c) == Watermark(0, 30)


def test_empty_ring_starts_a_fresh_round_at_zero() -> None:
    ring = RingAllocator(100, overcommit_rounds=0)
    ring.free(ring.assign(30))
    fresh = ring.assign(90)  # would not fit at offset 30 without padding a round
    assert fresh is not None and fresh.offset == 0 and fresh.writable(ring.watermark)


def test_double_free_and_foreign_region_are_errors() -> None:
    ring = RingAllocator(100)
    a = ring.assign(10)
    ring.assign(10)
    ring.free(a)
    with pytest.raises(ValueError, match=r"already freed|not live"):
        ring.free(a)
    with pytest.raises(ValueError, match="not live"):
        ring.free(Region(500, 10, 100))


class RingMachine(RuleBasedStateMachine):
    """A writer that respects the watermark never clobbers live data; the ring drains."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 256
        self.ring = RingAllocator(self.capacity, overcommit_rounds=1)
        self.memory = [-1] * self.capacity  # which region's data each byte holds
        self.assigned: list[Region] = []  # assigned, not yet written
        self.written: list[Region] = []  # data present, not yet freed

    @rule(size=st.integers(1, 256))
    def assign(self, size: int) -> None:
        region = self.ring.assign(size)
        if region is not None:
            assert region.offset + region.size <= self.capacity  # never straddles the end
            self.assigned.append(region)

    @precondition(lambda self: self.assigned)
    @rule(pick=st.integers(0, 10_000))
    def write(self, pick: int) -> None:
        writable = [r for r in self.assigned if r.writable(self.ring.watermark)]
        if not writable:
            return
        region = writable[pick % len(writable)]
        for live in self.written:  # a writable region overlaps no region holding live data
            assert (
                region.offset + region.size <= live.offset
                or live.offset + live.size <= region.offset
            )
        for i in range(region.offset, region.offset + region.size):
            self.memory[i] = region.start
        self.assigned.remove(region)
        self.written.append(region)

    @precondition(lambda self: self.written)
    @rule(pick=st.integers(0, 10_000))
    def read_and_free(self, pick: int) -> None:
        region = self.written.pop(pick % len(self.written))
        assert all(
            self.memory[i] == region.start
            for i in range(region.offset, region.offset + region.size)
        )
        self.ring.free(region)

    @invariant()
    def watermark_never_passes_a_live_region(self) -> None:
        position = self.ring.watermark.position(self.capacity)
        for region in self.assigned + self.written:
            assert position <= region.start

    def teardown(self) -> None:
        # Drain: write and free everything still assigned, in order; the ring empties.
        for region in sorted(self.written, key=lambda r: r.start):
            self.ring.free(region)
        for region in sorted(self.assigned, key=lambda r: r.start):
            assert region.writable(self.ring.watermark)
            self.ring.free(region)
        assert self.ring.is_empty and self.ring.num_live == 0
        fresh = self.ring.assign(self.capacity)
        assert fresh is not None and fresh.offset == 0 and fresh.writable(self.ring.watermark)


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
