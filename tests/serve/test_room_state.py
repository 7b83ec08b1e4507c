"""Prefill ranks > 0 learn rooms over the TP group: the publisher and the mirror.

The channel here is an in-process queue with the TP group's contract (rank 0
publishes from one thread, a rank listens on one); `tests/serve/test_pd.py` runs
the real thing (gloo) in prefill TP2 topologies.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time

import pytest
from fastapi.testclient import TestClient

from pdctl.serve.bootstrap import FirstToken, Rooms, bootstrap_app
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.room_state import RoomMirror, RoomPublisher, RoomSnapshot, RoomWait
from pdctl.staging.doorbell import BoxInfo, Ticket

LAYOUT = {"page_size": 16, "num_layers": 2, "head_dim": 8, "elem_bytes": 4}


class QueueChannel:
    def __init__(self) -> None:
        self.messages: queue.Queue[bytes | None] = queue.Queue()
        self.published = 0

    def publish(self, message: bytes | None) -> None:
        self.published += 1
        self.messages.put(message)

    def listen(self) -> bytes | None:
        return self.messages.get(timeout=10)


def registration(room: int, rank: int) -> proto.Registration:
    return proto.Registration(
        room=room, decode_rank=rank, decode_tp=2, decode_name=f"decode rank {rank}",
        transport="", num_tokens=32, page_size=16, mode="staging", kv_heads=2, head_dim=8,
        num_layers=2, elem_bytes=4, segment_bytes=1 << 20,
    )  # fmt: skip


def segment(index: int) -> proto.SegmentRegion:
    return proto.SegmentRegion(index, index, 1, 4096 * (index + 1), 0, 4096, 4096, (0, 0))


def test_room_waits_hold_like_the_registry_waits() -> None:
    assert RoomWait().holds({}) is True
    assert RoomWait.registered().holds({}) is False
    assert RoomWait(ranks=2).holds({0: [], 1: [0]}) is True
    assert RoomWait.registered(1).holds({1: []}) is True
    assert RoomWait.registered(0).holds({1: []}) is False
    assert RoomWait.offered(1, 2).holds({1: [0, 2]}) is True
    assert RoomWait.offered(1, 1).holds({1: [0, 2]}) is False
    assert RoomWait.from_query(0, None, 3) == RoomWait()  # a segment needs its rank
    assert RoomWait.from_query(1, 2, 3) == RoomWait(1, 2, 3)


def test_a_mirror_sees_registrations_offers_and_the_end_of_a_room() -> None:
    rooms, channel = Rooms(LAYOUT, 30.0), QueueChannel()
    publisher = RoomPublisher(channel, rooms)
    rooms.on_change = publisher.changed
    mirror = RoomMirror(channel)
    waited: dict[str, object] = {}

    def sender() -> None:  # what a rank-1 sender does: wait for rank 1's segment 1
        waited["state"] = mirror.wait_for(7, RoomWait.offered(1, 1), 10.0)

    thread = threading.Thread(target=sender)
    thread.start()
    assert mirror.wait_for(7, RoomWait(ranks=1), 0.05).registrations == {}  # nothing yet
    rooms.register(registration(7, 0))
    rooms.register(registration(7, 1))
    assert set(mirror.wait_for(7, RoomWait(ranks=2), 5.0).registrations) == {0, 1}
    as_sender = mirror.snapshot(7, 5.0, RoomWait.registered(1))  # the sender's argument order
    assert set(as_sender.registrations) == {0, 1}
    rooms.add_segments(7, 1, [segment(0)])
    rooms.add_segments(7, 1, [segment(1)])
    thread.join(10)
    state = waited["state"]
    assert isinstance(state, RoomSnapshot)
    assert [s.index for s in state.registrations[1].segments] == [0, 1]
    rooms.close(7, "failed: decode went away")
    closed = mirror.wait_for(7, RoomWait.offered(0, 9), 5.0)
    assert closed.closed == "failed: decode went away"  # a closed room ends every wait
    publisher.close()
    deadline = time.monotonic() + 5
    while not mirror.ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mirror.ended  # the end of the channel reached the listener
    assert mirror.wait_for(8, RoomWait(ranks=1), 5.0).registrations == {}  # at once after the end


def busy_room(rooms: Rooms) -> list[proto.Registration]:
    """Room 9 started, registered by rank 1 (staged, two segments offered) and then rank
    0 (direct, with doorbells): the registrations as they came."""
    rooms.start(9)
    staged = registration(9, 1)
    rooms.register(staged)  # rank 1 first: the order of arrival is kept
    direct = registration(9, 0)
    direct.mode, direct.pages, direct.kv_bases = "direct", [4, 2], [[4096, 8192], [12288, 16384]]
    direct.bell = proto.BellOffer(BoxInfo("/dev/shm/box", 77, 8, 64), [Ticket(3, 5)])
    rooms.register(direct)
    rooms.add_segments(9, 1, [segment(0), segment(1)])
    return [staged, direct]


def test_a_snapshot_crosses_the_tp_group_whole() -> None:
    """The registry's snapshot, dumped as rank 0 publishes it and parsed as a mirror
    does, is the same snapshot and dumps to the same bytes."""
    rooms = Rooms(LAYOUT, 30.0)
    busy_room(rooms)
    registry = rooms.snapshot(9)
    assert list(registry.registrations) == [1, 0] and registry.registrations[0].bell is not None
    wire = RoomSnapshot.from_json(json.loads(json.dumps(registry.to_json())))
    assert wire == registry and json.dumps(wire.to_json()) == json.dumps(registry.to_json())
    empty = RoomSnapshot.empty(9)
    assert RoomSnapshot.from_json(json.loads(json.dumps(empty.to_json()))) == empty


def test_the_bootstrap_endpoint_answers_a_room_as_it_always_did() -> None:
    """The wire format: the fields in this order, decode ranks as text keys in the order
    they registered, each registration every field of it (`dataclasses.asdict`), prefill's
    first token as it was set (its pairs as lists); what a mirror gets is the same JSON."""
    rooms = Rooms(LAYOUT, 30.0)
    staged, direct = busy_room(rooms)
    first = FirstToken(token=5, logprob=-0.25, top=[(5, -0.25)], logit=None, cached_tokens=16)
    rooms.set_result(9, first)
    expected = {
        "room": 9,
        "started": True,
        "closed": None,
        "result": first,
        "registrations": {"1": dataclasses.asdict(staged), "0": dataclasses.asdict(direct)},
    }
    client = TestClient(bootstrap_app(rooms, b"s", {"tp": 1}))
    auth = {"authorization": "Bearer s"}
    for path in ("/bootstrap/room/9", "/bootstrap/result/9"):
        answer = client.get(path, headers=auth)
        assert answer.content == json.dumps(expected, separators=(",", ":")).encode()
    assert json.dumps(rooms.snapshot(9).to_json()) == json.dumps(expected)
    rooms.close(9, "finished")
    closed = {**expected, "closed": "finished", "registrations": {}}
    answer = client.get("/bootstrap/room/9", headers=auth)
    assert answer.content == json.dumps(closed, separators=(",", ":")).encode()


def test_a_snapshot_keeps_the_segments_offered_when_it_was_taken() -> None:
    rooms = Rooms(LAYOUT, 30.0)
    busy_room(rooms)
    before = rooms.snapshot(9)
    rooms.add_segments(9, 1, [segment(2)])
    assert [s.index for s in before.registrations[1].segments] == [0, 1]
    assert [s.index for s in rooms.snapshot(9).registrations[1].segments] == [0, 1, 2]


@pytest.mark.parametrize(
    "change",
    [
        {"started": 1},
        {"closed": 5},
        {"registrations": []},
        {"room": -1},
        {"extra": True},
        {"registrations": {"0": {"room": 1}}},
    ],
)
def test_a_malformed_snapshot_is_refused(change: dict[str, object]) -> None:
    data = {**RoomSnapshot.empty(3).to_json(), **change}
    with pytest.raises(ValueError):
        RoomSnapshot.from_json(data)


def test_changes_that_pile_up_go_out_as_one_snapshot() -> None:
    rooms = Rooms(LAYOUT, 30.0)
    gate = threading.Event()

    class SlowChannel(QueueChannel):
        def publish(self, message: bytes | None) -> None:
            gate.wait(10)  # the first broadcast is in flight while the offers arrive
            super().publish(message)

    channel = SlowChannel()
    publisher = RoomPublisher(channel, rooms)
    rooms.on_change = publisher.changed
    rooms.register(registration(3, 0))
    for index in range(20):
        rooms.add_segments(3, 0, [segment(index)])
    gate.set()
    publisher.close()
    assert channel.published <= 3  # the registration, the piled-up offers, the end
    mirror = RoomMirror(channel)
    state = mirror.wait_for(3, RoomWait.offered(0, 19), 5.0)
    assert len(state.registrations[0].segments) == 20


def test_rooms_are_purged_once_a_tick_not_at_every_lookup(monkeypatch) -> None:
    """Thousands of tombstones are walked once per PURGE_EVERY_S, not at each of the
    lookups every waiter makes at every change; what expires still expires."""
    from pdctl.serve import bootstrap

    clock = [time.monotonic()]  # a room's `created` stays the real clock's: near this
    monkeypatch.setattr(bootstrap.time, "monotonic", lambda: clock[0])
    rooms = Rooms(LAYOUT, expiry_s=30.0)
    for room in range(3000):
        rooms.start(room)
        rooms.close(room, "finished")
    walks = []

    class Counted(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def, override]
            walks.append(1)
            return super().items()

    rooms._rooms = Counted(rooms._rooms)
    rooms.start(5000)  # a room whose decode never registers
    rooms.snapshot(6000)  # a registration-side room no prefill request ever started
    for _ in range(500):  # lookups within one tick
        rooms.snapshot(5000)
    assert len(walks) <= 1
    clock[0] += bootstrap.PURGE_EVERY_S + 31  # past the expiry: the unstarted room expires
    assert rooms.snapshot(6000).closed == "expired: no prefill request for this room"
    assert rooms.snapshot(5000).closed is None  # started: its own timeouts end it
    clock[0] += bootstrap.TOMBSTONE_S  # the tombstones go, at the next tick
    rooms.snapshot(5000)
    assert rooms.open_rooms() == 1 and len(rooms._rooms) <= 3
