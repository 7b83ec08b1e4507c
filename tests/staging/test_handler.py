"""Decode-side ordering: the scatter waits on the room's event; release drains only if needed."""

from __future__ import annotations

import pytest
import torch

from pdctl.staging import device as dev
from pdctl.staging import handler as handler_module
from pdctl.staging.buffer import init_staging_allocator
from pdctl.staging.digest import block_digests
from pdctl.staging.handler import DecodeStagingHandler, DigestMismatch
from pdctl.staging.kernels import gather_all_layers_to_staging
from pdctl.staging.layout import Segment, StagingLayout, head_slices
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
    gather_all_layers_to_staging(
        prefill_k, prefill_v, pages, view, src_head_start=0, num_heads=2, page_size=PAGE
    )
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
    state = handler.register_room(7, [3, 4], scheduler_stream)
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
    state = handler.register_room(5, [0, 1], ready=scheduler_event)
    assert state.ready is scheduler_event and recorded == []


def test_release_without_inflight_scatter_does_not_synchronize(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(dev, "synchronize_stream", lambda stream: calls.append(stream))
    monkeypatch.setattr(dev, "synchronize", lambda device: calls.append(device))
    handler, _, _ = make_handler()
    handler.register_room(1, [0, 1], None)
    segment = Segment(0, 0, 2)
    region = handler.assign_region(1, segment)
    handler.scatter(1, region, segment)
    handler.reap(1)
    handler.release_room(1)
    assert calls == []
    assert handler.ring.allocator.is_empty


def test_release_with_inflight_scatter_drains_once(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(dev, "synchronize_stream", lambda stream: calls.append(stream))
    handler, _, _ = make_handler()
    handler.register_room(1, [0, 1], None)
    monkeypatch.setattr(dev, "create_device_event", lambda device: RecordingEvent([], done=False))
    segment = Segment(0, 0, 2)
    region = handler.assign_region(1, segment)
    handler.scatter(1, region, segment)
    assert handler.has_inflight(1)
    handler.release_room(1)
    assert calls == [handler.scatter_stream]
    assert handler.ring.allocator.is_empty and 1 not in handler.rooms


def test_received_kv_lands_in_the_rooms_pages_and_digests_agree() -> None:
    handler, k, v = make_handler()
    pk, pv = random_kv(LAYERS, 32 * PAGE, HEADS, DIM, torch.float32, seed=8)
    src_pages, dst_pages = random_pages(32, 6, 1), random_pages(32, 6, 2)
    handler.register_room(9, dst_pages, None)
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
    handler.release_room(9)


def test_corrupted_bytes_are_named_by_layer_and_kv() -> None:
    handler, _, _ = make_handler()
    pk, pv = random_kv(LAYERS, 32 * PAGE, HEADS, DIM, torch.float32, seed=8)
    handler.register_room(3, [0, 1], None)
    segment = Segment(0, 0, 2)
    region = handler.assign_region(3, segment)
    sent = fill_region(handler, region, segment, pk, pv, [4, 5])
    chunk = region.size // (2 * LAYERS)
    handler.ring.view(region)[3 * chunk + 5] ^= 0xFF  # layer 1, V
    assert handler.check_digests(region, segment, sent) == DigestMismatch(0, 0, 1, "V")
    handler.release_room(3)
    assert handler.ring.allocator.is_empty


def test_unknown_room_and_device_checks() -> None:
    handler, _, _ = make_handler()
    with pytest.raises(KeyError, match="room 42 is not registered"):
        handler.assign_region(42, Segment(0, 0, 1))
    handler.register_room(1, [0], None)
    with pytest.raises(ValueError, match="already registered"):
        handler.register_room(1, [0], None)
    meta_k = [torch.empty(16, 2, 4, device="meta")]
    with pytest.raises(ValueError, match="needs an indexed device, got meta"):
        DecodeStagingHandler(meta_k, meta_k, page_size=4, ring=handler.ring, layout=handler.layout)
