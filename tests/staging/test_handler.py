"""Decode-side staging: the scatter waits on the room's event, closing drains only if needed,
and the whole operations (open, offer, land, close) put the sent bytes in the pages, name
what was corrupted, and give every region back."""

from __future__ import annotations

import threading

import pytest
import torch

from pdctl.staging import device as dev
from pdctl.staging import handler as handler_module
from pdctl.staging.buffer import init_staging_allocator
from pdctl.staging.digest import block_digests
from pdctl.staging.handler import DecodeStagingHandler, DigestMismatch, LandFaults
from pdctl.staging.kernels import KVSlice, gather_slice
from pdctl.staging.layout import Segment, StagingLayout, head_slices, plan_segments
from tests.staging.kv_factory import as_bits, random_kv, random_pages

LAYERS, HEADS, DIM, PAGE = 2, 4, 8, 4


class RecordingEvent:
    def __init__(self, log: list, done: bool = True) -> None:
        self.log, self.done = log, done

    def record(self, stream=None) -> None:
        self.log.append(("record", self, stream))

    def query(self) -> bool:
        return self.done


def make_handler(ring_bytes: int = 1 << 16):
    k, v = random_kv(LAYERS, 32 * PAGE, HEADS // 2, DIM, torch.float32, seed=5)  # decode TP2 rank
    layout = StagingLayout(LAYERS, DIM, 4, head_slices(HEADS, 1, 2, 0))
    ring = init_staging_allocator(ring_bytes, device_type="cpu")
    return DecodeStagingHandler(k, v, page_size=PAGE, ring=ring, layout=layout), k, v


def fill_region(handler, region, segment, prefill_k, prefill_v, pages) -> list[list[int]]:
    """Act as prefill + transport: gather into the ring region, return the digests sent."""
    view = handler.ring.view(region)
    gather_slice(prefill_k, prefill_v, pages, view, KVSlice(0, 2, PAGE))
    return [block_digests(view, LAYERS)]


def test_scatter_waits_on_the_rooms_event_not_the_stream(monkeypatch) -> None:
    log: list = []
    monkeypatch.setattr(dev, "create_device_event", lambda device: RecordingEvent(log))
    real_wait = dev.stream_wait_event
    monkeypatch.setattr(
        dev,
        "stream_wait_event",
        lambda stream, event: (log.append(("wait", event, stream)), real_wait(stream, event)),
    )
    real_scatter = handler_module.scatter_staging_to_kv
    monkeypatch.setattr(
        handler_module,
        "scatter_staging_to_kv",
        lambda *a, **k: (log.append(("scatter",)), real_scatter(*a, **k))[1],
    )
    handler, _, _ = make_handler()
    scheduler_stream = object()
    handler.open_room(7, [3, 4], scheduler_stream)
    state = handler.rooms[7]
    assert log[0] == ("record", state.ready, scheduler_stream)  # the edge, on the scheduler stream
    segment = Segment(0, 0, 2)
    region = handler.assign_region(7, segment)
    pk, pv = random_kv(LAYERS, 32 * PAGE, HEADS, DIM, torch.float32, seed=6)
    fill_region(handler, region, segment, pk, pv, [1, 2])
    handler.scatter(7, region, segment)
    kinds = [entry[0] for entry in log]
    wait = kinds.index("wait")
    assert log[wait][1] is state.ready and log[wait][2] is handler.scatter_stream
    assert wait < kinds.index("scatter")


def test_a_recorded_event_from_another_thread_is_the_edge(monkeypatch) -> None:
    """The decode receiver registers rooms on its own thread: it hands over the event
    the scheduler recorded; the handler must not record one on a stream of its own
    (a CUDA event refuses to record on an event, as the H200 run showed)."""
    recorded: list = []
    monkeypatch.setattr(
        dev, "create_device_event", lambda device: recorded.append(device) or object()
    )
    handler, _, _ = make_handler()
    recorded.clear()
    scheduler_event = object()
    handler.open_room(5, [0, 1], ready=scheduler_event)
    assert handler.rooms[5].ready is scheduler_event and recorded == []


def test_close_without_inflight_scatter_does_not_synchronize(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(dev, "synchronize_stream", lambda stream: calls.append(stream))
    monkeypatch.setattr(dev, "synchronize", lambda device: calls.append(device))
    handler, _, _ = make_handler()
    handler.open_room(1, [0, 1], None)
    segment = Segment(0, 0, 2)
    region = handler.assign_region(1, segment)
    handler.scatter(1, region, segment)
    handler.reap(1)
    handler.close_room(1)
    assert calls == []
    assert handler.ring.allocator.is_empty


def test_close_with_inflight_scatter_drains_once(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(dev, "synchronize_stream", lambda stream: calls.append(stream))
    handler, _, _ = make_handler()
    handler.open_room(1, [0, 1], None)
    monkeypatch.setattr(dev, "create_device_event", lambda device: RecordingEvent([], done=False))
    segment = Segment(0, 0, 2)
    region = handler.assign_region(1, segment)
    handler.scatter(1, region, segment)
    assert handler.has_inflight(1)
    handler.close_room(1)
    assert calls == [handler.scatter_stream]
    assert handler.ring.allocator.is_empty and 1 not in handler.rooms


def test_received_kv_lands_in_the_rooms_pages_and_digests_agree() -> None:
    handler, k, v = make_handler()
    pk, pv = random_kv(LAYERS, 32 * PAGE, HEADS, DIM, torch.float32, seed=8)
    src_pages, dst_pages = random_pages(32, 6, 1), random_pages(32, 6, 2)
    handler.open_room(9, dst_pages, None)
    segment = Segment(0, 0, 6)
    region = handler.assign_region(9, segment)
    sent = fill_region(handler, region, segment, pk, pv, src_pages)
    assert handler.check_digests(region, segment, sent) is None
    handler.scatter(9, region, segment)
    watermark = handler.reap(9)
    assert watermark.position(handler.ring.allocator.capacity) == region.end
    src_rows = torch.tensor([int(p) * PAGE + i for p in src_pages for i in range(PAGE)])
    dst_rows = torch.tensor([int(p) * PAGE + i for p in dst_pages for i in range(PAGE)])
    for layer in range(LAYERS):
        assert torch.equal(as_bits(k[layer])[dst_rows], as_bits(pk[layer])[src_rows, 0:2])
        assert torch.equal(as_bits(v[layer])[dst_rows], as_bits(pv[layer])[src_rows, 0:2])
    handler.close_room(9)


def test_corrupted_bytes_are_named_by_layer_and_kv() -> None:
    handler, _, _ = make_handler()
    pk, pv = random_kv(LAYERS, 32 * PAGE, HEADS, DIM, torch.float32, seed=8)
    handler.open_room(3, [0, 1], None)
    segment = Segment(0, 0, 2)
    region = handler.assign_region(3, segment)
    sent = fill_region(handler, region, segment, pk, pv, [4, 5])
    chunk = region.size // (2 * LAYERS)
    handler.ring.view(region)[3 * chunk + 5] ^= 0xFF  # layer 1, V
    assert handler.check_digests(region, segment, sent) == DigestMismatch(0, 0, 1, "V")
    handler.close_room(3)
    assert handler.ring.allocator.is_empty


def test_unknown_room_and_device_checks() -> None:
    handler, _, _ = make_handler()
    with pytest.raises(KeyError, match="room 42 is not registered"):
        handler.assign_region(42, Segment(0, 0, 1))
    handler.open_room(1, [0], None)
    with pytest.raises(ValueError, match="already registered"):
        handler.open_room(1, [0], None)
    meta_k = [torch.empty(16, 2, 4, device="meta")]
    with pytest.raises(ValueError, match="needs an indexed device, got meta"):
        DecodeStagingHandler(meta_k, meta_k, page_size=4, ring=handler.ring, layout=handler.layout)


# -- whole operations: prefill TP2 -> decode TP1, so every region has two writers -------
def make_two_writer_handler(ring_bytes: int, **kwargs):
    """Decode TP1 (all 4 heads) fed by prefill TP2 (2 heads each); returns the handler,
    decode's K and V and each prefill rank's K and V."""
    k, v = random_kv(LAYERS, 32 * PAGE, HEADS, DIM, torch.float32, seed=11)
    layout = StagingLayout(LAYERS, DIM, 4, head_slices(HEADS, 2, 1, 0))
    ring = init_staging_allocator(ring_bytes, device_type="cpu", overcommit_rounds=0)
    handler = DecodeStagingHandler(k, v, page_size=PAGE, ring=ring, layout=layout, **kwargs)
    prefill = [
        random_kv(LAYERS, 32 * PAGE, HEADS // 2, DIM, torch.float32, seed=20 + r) for r in (0, 1)
    ]
    return handler, k, v, prefill


def write_offer(handler, offer, prefill, src_pages) -> list[list[int]]:
    """Act as every prefill rank and the transport: gather the segment's pages into the
    offered address (ring base + offset + block offset); return the digests sent."""
    segment = offer.segment
    pages = src_pages[segment.page_start : segment.page_start + segment.num_pages]
    tokens = segment.num_tokens(PAGE)
    ring = handler.ring.buffer
    sent = []
    for writer, piece in enumerate(handler.layout.slices):
        start = offer.address - ring.ptr + handler.layout.block_offset(writer, tokens)
        block = ring.view(start, handler.layout.block_bytes(writer, tokens))
        pk, pv = prefill[piece.prefill_rank]
        gather_slice(pk, pv, pages, block, piece.source(PAGE))
        sent.append(block_digests(block, LAYERS))
    return sent


def assert_pages_hold(k, v, prefill, src_pages, dst_pages) -> None:
    src_rows = torch.tensor([int(p) * PAGE + i for p in src_pages for i in range(PAGE)])
    dst_rows = torch.tensor([int(p) * PAGE + i for p in dst_pages for i in range(PAGE)])
    for rank, (pk, pv) in enumerate(prefill):
        heads = slice(2 * rank, 2 * rank + 2)
        for layer in range(LAYERS):
            assert torch.equal(as_bits(k[layer])[dst_rows, heads], as_bits(pk[layer])[src_rows])
            assert torch.equal(as_bits(v[layer])[dst_rows, heads], as_bits(pv[layer])[src_rows])


def test_offer_land_close_moves_a_room_through_a_ring_smaller_than_it() -> None:
    layout_bytes = StagingLayout(LAYERS, DIM, 4, head_slices(HEADS, 2, 1, 0)).bytes_per_token()
    segment_bytes = 2 * PAGE * layout_bytes  # two pages a segment
    handler, k, v, prefill = make_two_writer_handler(2 * segment_bytes)  # two regions fit
    src_pages, dst_pages = random_pages(32, 7, 1), random_pages(32, 7, 2)
    plan = plan_segments(7, PAGE, layout_bytes, segment_bytes)
    assert len(plan) == 4
    handler.open_room(4, dst_pages, ready=object())  # CPU: any ready event is complete
    allocator = handler.ring.allocator
    first = handler.offer(4, plan)
    assert [o.segment.index for o in first] == [0, 1]  # the ring holds two regions
    assert handler.offer(4, plan) == []  # offered once; no space for segment 2 yet
    assert handler.region_of(4, plan[2]) is None
    for o in first:
        assert o.address == handler.ring.buffer.ptr + o.region.offset
        assert o.region.writable(o.watermark) and handler.region_of(4, o.segment) == o.region
    offers = {o.segment.index: o for o in first}
    for segment in plan:
        if segment.index not in offers:
            offers.update((o.segment.index, o) for o in handler.offer(4, plan))
        sent = write_offer(handler, offers[segment.index], prefill, src_pages)
        live = allocator.num_live
        assert handler.land(4, segment, sent) is None
        assert allocator.num_live == live - 1  # landing freed the segment's region
    assert allocator.is_empty and sorted(offers) == [0, 1, 2, 3]
    assert_pages_hold(k, v, prefill, src_pages, dst_pages)
    handler.close_room(4)
    assert 4 not in handler.rooms and allocator.is_empty


def test_a_corrupted_ring_byte_is_named_by_writer_layer_and_kv() -> None:
    handler, k, _, prefill = make_two_writer_handler(1 << 16)
    before = [t.clone() for t in k]
    handler.open_room(3, [0, 1], ready=object())
    plan = (Segment(0, 0, 2),)
    (offer,) = handler.offer(3, plan)
    sent = write_offer(handler, offer, prefill, [4, 5])
    tokens, layout = 2 * PAGE, handler.layout
    chunk = layout.block_bytes(1, tokens) // (2 * LAYERS)  # one layer's K or V of writer 1
    position = offer.region.offset + layout.block_offset(1, tokens) + 2 * chunk + 3
    handler.ring.buffer.tensor[position] ^= 0xFF  # writer 1 (prefill rank 1), layer 1, K
    assert handler.land(3, plan[0], sent) == DigestMismatch(1, 1, 1, "K", "ring")
    assert handler.ring.allocator.is_empty  # freed even though it failed
    # nothing was scattered into the pages
    assert all(torch.equal(as_bits(a), as_bits(b)) for a, b in zip(k, before, strict=True))
    with pytest.raises(ValueError, match="segment 0 of room 3 holds no ring region"):
        handler.land(3, plan[0], sent)  # landed once
    handler.close_room(3)


def test_a_skipped_scatter_is_caught_in_the_pages() -> None:
    """The drop-scatter fault: the ring is right, the pages are stale, land says so."""
    handler, _, _, prefill = make_two_writer_handler(1 << 16)
    handler.open_room(6, [2, 3], ready=object(), faults=LandFaults(skip_first_scatter=True))
    plan = (Segment(0, 0, 1), Segment(1, 1, 1))
    offers = handler.offer(6, plan)
    sent = [write_offer(handler, o, prefill, [7, 8]) for o in offers]
    assert handler.land(6, plan[0], sent[0]) == DigestMismatch(0, 0, 0, "K", "pages")
    assert handler.land(6, plan[1], sent[1]) is None  # only the first scatter is skipped
    assert handler.close_room(6) == handler.ring.allocator.watermark
    assert handler.ring.allocator.is_empty


def test_close_gives_back_regions_never_landed() -> None:
    handler, _, _, _ = make_two_writer_handler(1 << 16)
    handler.open_room(8, [0, 1, 2], ready=object())
    plan = tuple(Segment(i, i, 1) for i in range(3))
    assert len(handler.offer(8, plan)) == 3 and handler.ring.allocator.num_live == 3
    handler.close_room(8)
    assert handler.ring.allocator.is_empty
    with pytest.raises(KeyError, match="room 8 is not registered"):
        handler.offer(8, plan)


def test_check_pages_names_a_corrupted_page_in_a_later_segment() -> None:
    """The direct path's check: pages written without the ring, digests per segment."""
    handler, k, v, prefill = make_two_writer_handler(1 << 16)
    pages = [5, 9, 1]
    plan = (Segment(0, 0, 2), Segment(1, 2, 1))
    expected = []
    for piece in handler.layout.slices:
        pk, pv = prefill[piece.prefill_rank]
        digests = []
        for segment in plan:
            chunk = pages[segment.page_start : segment.page_start + segment.num_pages]
            block = torch.empty(2 * LAYERS * len(chunk) * PAGE * 2 * DIM * 4, dtype=torch.uint8)
            gather_slice(pk, pv, chunk, block, KVSlice(0, 2, PAGE))
            digests += block_digests(block, LAYERS)
            for layer in range(LAYERS):  # the direct write: heads into decode's pages
                rows = torch.tensor([p * PAGE + i for p in chunk for i in range(PAGE)])
                heads = slice(piece.dst_head_start, piece.dst_head_start + 2)
                k[layer][rows, heads] = pk[layer][rows]
                v[layer][rows, heads] = pv[layer][rows]
        expected.append(digests)
    assert handler.check_pages(pages, plan, expected) is None
    as_bits(v[1])[1 * PAGE + 2, 3, 0] ^= 0x10  # page 1 (segment 1), head 3 (writer 1), layer 1 V
    assert handler.check_pages(pages, plan, expected) == DigestMismatch(1, 1, 1, "V", "pages")
    short = [expected[0], expected[1][:-1]]
    assert handler.check_pages(pages, plan, short) == DigestMismatch(1, 1, 0, "K", "pages")


def test_handlers_sharing_a_ring_share_its_lock() -> None:
    """Two handlers (two prefill TPs) on one ring: while one thread holds the shared
    lock, the other handler's offer waits for it."""
    lock = threading.RLock()
    first, _, _, _ = make_two_writer_handler(1 << 16, lock=lock)
    k, v = random_kv(LAYERS, 32 * PAGE, HEADS, DIM, torch.float32, seed=12)
    layout = StagingLayout(LAYERS, DIM, 4, head_slices(HEADS, 1, 1, 0))
    second = DecodeStagingHandler(k, v, page_size=PAGE, ring=first.ring, layout=layout, lock=lock)
    second.open_room(1, [0], ready=object())
    held, release, offered = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    worker = threading.Thread(target=lambda: (second.offer(1, (Segment(0, 0, 1),)), offered.set()))
    worker.start()
    assert not offered.wait(0.2)  # blocked on the lock the other thread holds
    release.set()
    assert offered.wait(5)
    holder.join()
    worker.join()
    assert first.ring.allocator.num_live == 1
    second.close_room(1)
