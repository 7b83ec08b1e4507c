"""Fenced ring regions (issue 36): a room closed before its writers finished keeps the
regions it did not land until `release_fenced`, and nothing the ring hands out
meanwhile overlays a byte of them; once released, the ring comes back whole.
Unit cases and a hypothesis state machine over the handler's whole operations."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdctl.staging.allocator import Region
from pdctl.staging.buffer import init_staging_allocator
from pdctl.staging.handler import DecodeStagingHandler
from pdctl.staging.layout import Segment, StagingLayout, head_slices
from tests.staging.kv_factory import random_kv

LAYERS, HEADS, DIM, PAGE = 2, 4, 8, 4
ROOM_PAGES = 4  # pages [room's first page ...] of a room; a segment is one page


def make_handler(ring_bytes: int) -> DecodeStagingHandler:
    """As the receiver makes it: no overcommit, so an offered region is writable."""
    k, v = random_kv(LAYERS, 64 * PAGE, HEADS // 2, DIM, torch.float32, seed=5)
    layout = StagingLayout(LAYERS, DIM, 4, head_slices(HEADS, 1, 2, 0))
    ring = init_staging_allocator(ring_bytes, device_type="cpu", overcommit_rounds=0)
    return DecodeStagingHandler(k, v, page_size=PAGE, ring=ring, layout=layout)


def overlaps(a: Region, b: Region) -> bool:
    """Whether two regions share a physical byte (neither straddles the ring's end)."""
    return a.offset < b.offset + b.size and b.offset < a.offset + a.size


def test_a_fenced_room_keeps_its_regions_until_released() -> None:
    handler = make_handler(1 << 12)
    segment_bytes = handler.layout.region_bytes(PAGE)
    handler.open_room(1, list(range(ROOM_PAGES)))
    offered = handler.offer(1, [Segment(i, i, 1) for i in range(ROOM_PAGES)])
    assert offered
    handler.close_room(1, fence=True)
    assert handler.num_fenced == len(offered) and 1 in handler.fenced
    assert handler.ring.allocator.num_live == len(offered)  # still assigned in the ring
    handler.open_room(2, list(range(8, 8 + ROOM_PAGES)))
    later = handler.offer(2, [Segment(i, i, 1) for i in range(ROOM_PAGES)])
    for fresh in later:  # whatever the ring hands out now lies beside the fenced regions
        assert not any(overlaps(fresh.region, old.region) for old in offered)
    assert len(later) < ROOM_PAGES or segment_bytes * 2 * ROOM_PAGES <= (1 << 12)
    assert handler.release_fenced(1) == len(offered)
    assert handler.release_fenced(1) == 0 and handler.num_fenced == 0
    handler.close_room(2)
    assert handler.ring.allocator.is_empty


def test_closing_without_the_fence_frees_at_once() -> None:
    handler = make_handler(1 << 12)
    handler.open_room(1, list(range(ROOM_PAGES)))
    assert handler.offer(1, [Segment(0, 0, 1)])
    handler.close_room(1)
    assert handler.fenced == {} and handler.ring.allocator.is_empty


class FencedRing(RuleBasedStateMachine):
    """Rooms open, take regions, land some, and either land the rest and close or are
    given up (closed with the fence: a writer may still write what they had not
    landed) until their writers stopped. The model keeps its own record of what a
    writer may still write; nothing offered meanwhile may overlay a byte of it."""

    def __init__(self) -> None:
        super().__init__()
        self.handler = make_handler(4 * 1024)  # a few one-page segments: it wraps often
        self.next_room = 0
        self.open: dict[int, list[Segment]] = {}  # room -> segments not offered yet
        self.offered: dict[int, list[tuple[Segment, Region]]] = {}  # not landed yet
        self.writing: dict[int, list[Region]] = {}  # given-up room -> regions still written

    @rule()
    def open_room(self) -> None:
        room = self.next_room
        self.next_room += 1
        pages = [(room * ROOM_PAGES + i) % 60 for i in range(ROOM_PAGES)]
        self.handler.open_room(room, pages)
        self.open[room] = [Segment(i, i, 1) for i in range(ROOM_PAGES)]
        self.offered[room] = []

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def offer(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(sorted(self.open)))
        for offer in self.handler.offer(room, self.open[room]):
            assert offer.region.writable(offer.watermark)  # prefill may write it at once
            for regions in self.writing.values():  # so it must overlay nothing still written
                assert not any(overlaps(offer.region, written) for written in regions)
            self.open[room].remove(offer.segment)
            self.offered[room].append((offer.segment, offer.region))

    def _land(self, room: int) -> None:
        segment, region = self.offered[room].pop(0)
        self.handler.scatter(room, region, segment)  # its writer notified: scatter, free
        self.handler.reap(room)

    @precondition(lambda self: any(self.offered.values()))
    @rule(data=st.data())
    def land(self, data: st.DataObject) -> None:
        self._land(data.draw(st.sampled_from(sorted(r for r, o in self.offered.items() if o))))

    @precondition(lambda self: self.open)
    @rule(data=st.data(), given_up=st.booleans())
    def close(self, data: st.DataObject, given_up: bool) -> None:
        room = data.draw(st.sampled_from(sorted(self.open)))
        if not given_up:  # every writer notified: all landed, nothing is written any more
            while self.offered[room]:
                self._land(room)
        held = [region for _, region in self.offered.pop(room)]
        del self.open[room]
        self.handler.close_room(room, fence=given_up)
        if held:
            self.writing[room] = held

    @precondition(lambda self: self.writing)
    @rule(data=st.data())
    def writers_stopped(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from(sorted(self.writing)))
        assert self.handler.release_fenced(room) == len(self.writing.pop(room))

    @invariant()
    def every_live_region_has_an_owner(self) -> None:
        live = sorted(r.start for r in self.handler.ring.allocator.live_regions())
        owned = [r.start for regions in self.writing.values() for r in regions]
        owned += [r.start for held in self.offered.values() for _, r in held]
        assert live == sorted(owned)
        assert self.handler.num_fenced == sum(len(r) for r in self.writing.values())

    def teardown(self) -> None:
        for room in list(self.open):
            self.handler.close_room(room, fence=True)
        for room in list(self.handler.fenced):
            self.handler.release_fenced(room)
        assert self.handler.ring.allocator.is_empty


TestFencedRing = FencedRing.TestCase
TestFencedRing.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
