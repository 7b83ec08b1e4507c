"""Prefill ranks above 0 learn each room's registrations over the TP group.

Decode ranks register rooms (and offer ring regions) on prefill rank 0's bootstrap
endpoint. Every prefill rank sends its own head slice, so every rank needs that
state: rank 0 publishes each room's snapshot when it changes (`RoomPublisher`, one
thread, the TP group's control channel on host memory), and the other ranks keep
the latest snapshot of each room (`RoomMirror`) and wait on it exactly as rank 0's
senders wait on the registry itself (`Rooms.wait_for`): no HTTP polling of their
own rank 0, and a change reaches them within one broadcast.

A snapshot is the registry's own JSON (`Rooms.snapshot`): the room, whether it
started, how it closed, and every decode rank's registration with its segments.
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
from typing import Any, Protocol

log = logging.getLogger("pdctl.serve")
MAX_ROOMS = 4096  # rooms a mirror remembers, the least recently changed dropped first


class Channel(Protocol):
    def publish(self, message: bytes | None) -> None: ...

    def listen(self) -> bytes | None: ...


class SnapshotSource(Protocol):
    def snapshot(self, room: int) -> dict[str, Any]: ...


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
                self.channel.publish(json.dumps(self.rooms.snapshot(room)).encode())
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
        self._rooms: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._changed = threading.Condition()
        self.ended = False
        self._thread = threading.Thread(target=self._run, name="pdctl-room-mirror", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (message := self.channel.listen()) is not None:
                self.update(json.loads(message))
        except RuntimeError as exc:  # rank 0 died: waits end at their timeout
            log.warning("room state: lost prefill rank 0: %s", exc)
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def update(self, snapshot: dict[str, Any]) -> None:
        room = int(snapshot["room"])
        with self._changed:
            self._rooms[room] = snapshot
            self._rooms.move_to_end(room)
            while len(self._rooms) > MAX_ROOMS:  # closed or expired long ago
                self._rooms.popitem(last=False)
            self._changed.notify_all()

    def snapshot(self, room: int, wait: float, condition: RoomWait) -> dict[str, Any]:
        """The sender's view of a room (`sender.Snapshot`): `wait_for` in its argument order."""
        return self.wait_for(room, condition, wait)

    def wait_for(self, room: int, condition: RoomWait, timeout: float) -> dict[str, Any]:
        """As `Rooms.wait_for`: the snapshot once `condition` holds, the room closed, or
        `timeout` passed (then the latest snapshot, or an empty one)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                snapshot = self._rooms.get(room)
                if snapshot is not None and (snapshot.get("closed") or _holds(snapshot, condition)):
                    return snapshot
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.ended:
                    return snapshot or _empty(room)
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


def _holds(snapshot: dict[str, Any], condition: RoomWait) -> bool:
    registrations: dict[str, Any] = snapshot.get("registrations") or {}
    offered = {
        int(rank): [int(s["index"]) for s in registration.get("segments", [])]
        for rank, registration in registrations.items()
    }
    return condition.holds(offered)


def _empty(room: int) -> dict[str, Any]:
    return {"room": room, "started": False, "closed": None, "result": None, "registrations": {}}
