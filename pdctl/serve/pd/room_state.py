"""Prefill ranks above 0 learn each room's registrations over the TP group.

Decode ranks register rooms (and offer ring regions) on prefill rank 0's bootstrap
endpoint. Every prefill rank sends its own head slice, so every rank needs that
state: rank 0 publishes each room's snapshot when it changes (`RoomPublisher`, one
thread, the TP group's control channel on host memory), and the other ranks keep
the latest snapshot of each room (`RoomMirror`) and wait on it exactly as rank 0's
senders wait on the registry itself (`Rooms.wait_for`): no HTTP polling of their
own rank 0, and a change reaches them within one broadcast.

A snapshot (`RoomSnapshot`) is typed once: the room, whether it started, how it
closed, prefill's result, and every decode rank's registration with its segments.
Rank 0's registry makes it (`Rooms.snapshot`), a mirror parses it from rank 0's JSON
(`from_json`); on the wire, here and on the bootstrap endpoint, it is `to_json`.
Changes to one room that pile up while a broadcast is in flight go out as one
snapshot (the latest), so a burst of segment offers costs one message.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pdctl.serve.pd import protocol as proto

log = logging.getLogger("pdctl.serve")
MAX_ROOMS = 4096  # rooms a mirror remembers, the least recently changed dropped first


class Channel(Protocol):
    def publish(self, message: bytes | None) -> None: ...

    def listen(self) -> bytes | None: ...


class SnapshotSource(Protocol):
    def snapshot(self, room: int) -> RoomSnapshot: ...  # `Rooms.snapshot`


class RoomPublisher:
    """Rank 0: broadcasts the snapshot of every room that changed, from one thread."""

    def __init__(self, channel: Channel, rooms: SnapshotSource) -> None:
        self.channel, self.rooms = channel, rooms
        self._pending: OrderedDict[int, None] = OrderedDict()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="pdctl-room-publisher", daemon=True)
        self._thread.start()

    def changed(self, room: int) -> None:
        """The registry changed `room` (called by `Rooms`, outside its lock)."""
        with self._wake:
            self._pending[room] = None
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if not self._pending:  # closing, everything sent
                    break
                room, _ = self._pending.popitem(last=False)
            try:
                snapshot = self.rooms.snapshot(room)
                self.channel.publish(json.dumps(snapshot.to_json()).encode())
            except RuntimeError as exc:  # a rank died: the launcher sees it and stops us
                log.warning("room state: cannot reach the other prefill ranks: %s", exc)
                return
        try:
            self.channel.publish(None)
        except RuntimeError as exc:
            log.info("room state: the other prefill ranks are gone: %s", exc)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is pending, then the end; the listeners return."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)


class RoomMirror:
    """Ranks > 0: the latest snapshot of each room, fed by rank 0's publisher."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._rooms: OrderedDict[int, RoomSnapshot] = OrderedDict()
        self._changed = threading.Condition()
        self.ended = False
        self._thread = threading.Thread(target=self._run, name="pdctl-room-mirror", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (message := self.channel.listen()) is not None:
                self.update(RoomSnapshot.from_json(json.loads(message)))  # rank 0's own JSON
        except RuntimeError as exc:  # rank 0 died: waits end at their timeout
            log.warning("room state: lost prefill rank 0: %s", exc)
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def update(self, snapshot: RoomSnapshot) -> None:
        room = snapshot.room
        with self._changed:
            self._rooms[room] = snapshot
            self._rooms.move_to_end(room)
            while len(self._rooms) > MAX_ROOMS:  # closed or expired long ago
                self._rooms.popitem(last=False)
            self._changed.notify_all()

    def snapshot(self, room: int, wait: float, condition: RoomWait) -> RoomSnapshot:
        """The sender's view of a room (`sender.Snapshot`): `wait_for` in its argument order."""
        return self.wait_for(room, condition, wait)

    def wait_for(self, room: int, condition: RoomWait, timeout: float) -> RoomSnapshot:
        """As `Rooms.wait_for`: the snapshot once `condition` holds, the room closed, or
        `timeout` passed (then the latest snapshot, or an empty one)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                snapshot = self._rooms.get(room)
                if snapshot is not None and snapshot.ends(condition):
                    return snapshot
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.ended:
                    return snapshot or RoomSnapshot.empty(room)
                self._changed.wait(min(remaining, 0.5))


@dataclass(frozen=True)
class RoomWait:
    """What a sender waits for in a room: `ranks` decode ranks registered; with
    `decode_rank`, that rank registered; with `segment` too, that rank offered a ring
    region for segment `segment`. `RoomWait()` holds at once; `RoomWait.closed()` never
    (a wait on it ends when the room closes, or at its timeout)."""

    ranks: int = 0
    decode_rank: int | None = None
    segment: int | None = None
    until_closed: bool = False

    @staticmethod
    def registered(decode_rank: int | None = None) -> RoomWait:
        """Decode rank `decode_rank` registered (None: any one rank did)."""
        return RoomWait(ranks=1) if decode_rank is None else RoomWait(decode_rank=decode_rank)

    @staticmethod
    def offered(decode_rank: int, segment: int) -> RoomWait:
        return RoomWait(decode_rank=decode_rank, segment=segment)

    @staticmethod
    def closed() -> RoomWait:
        return RoomWait(until_closed=True)

    def holds(self, offered: Mapping[int, Iterable[int]]) -> bool:
        """Over decode rank -> the segment indices it offered."""
        if self.until_closed or len(offered) < self.ranks:
            return False
        if self.decode_rank is None:
            return True
        segments = offered.get(self.decode_rank)
        if segments is None or self.segment is None:
            return segments is not None
        return self.segment in segments

    @staticmethod
    def from_query(ranks: int, decode_rank: int | None, segment: int | None) -> RoomWait:
        return RoomWait(ranks, decode_rank, segment if decode_rank is not None else None)


@dataclass(frozen=True)
class RoomSnapshot:
    """One room as prefill's registry has it: made by the registry, or parsed from its
    JSON where it arrives; either way it owns its registrations (the registry's go on
    growing segments)."""

    room: int
    started: bool  # prefill's request for it arrived
    closed: str | None  # how it closed (None: open)
    result: Mapping[str, object] | None  # prefill's first token, for decode (carried here)
    registrations: Mapping[int, proto.Registration]  # decode rank -> its, as they came

    @staticmethod
    def empty(room: int) -> RoomSnapshot:
        return RoomSnapshot(room, False, None, None, {})

    @staticmethod
    def from_json(data: object) -> RoomSnapshot:
        """A snapshot from the registry's JSON, every field checked (ValueError)."""
        if not isinstance(data, dict) or set(data) != SNAPSHOT_FIELDS:
            raise ValueError(f"a room snapshot has exactly the fields {sorted(SNAPSHOT_FIELDS)}")
        started, closed, result = data["started"], data["closed"], data["result"]
        registrations = data["registrations"]
        if not isinstance(started, bool) or not isinstance(closed, (str, type(None))):
            raise ValueError("a room snapshot's started is true or false, closed text or null")
        if not isinstance(result, (dict, type(None))) or not isinstance(registrations, dict):
            raise ValueError("a room snapshot's result and registrations are JSON objects")
        return RoomSnapshot(
            proto.json_int(data, "room"),
            started,
            closed,
            result,
            {int(rank): proto.Registration.from_json(r) for rank, r in registrations.items()},
        )

    def to_json(self) -> dict[str, object]:
        """The room's JSON: what the bootstrap endpoint answers and rank 0 publishes."""
        return {
            "room": self.room,
            "started": self.started,
            "closed": self.closed,
            "result": self.result,
            "registrations": {str(rank): r.to_json() for rank, r in self.registrations.items()},
        }

    def offered(self) -> dict[int, list[int]]:
        """Decode rank -> the segment indices it offered ring regions for."""
        return {rank: [s.index for s in r.segments] for rank, r in self.registrations.items()}

    def ends(self, condition: RoomWait) -> bool:
        """A wait on `condition` ends here: it holds, or the room closed."""
        return bool(self.closed) or condition.holds(self.offered())


SNAPSHOT_FIELDS = {"room", "started", "closed", "result", "registrations"}
