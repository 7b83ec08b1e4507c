"""A prefill sender's waits on a room: decode's registrations, its ring regions, the end.

The room's state comes from a `Snapshot` function (rank 0: the bootstrap registry;
ranks above 0: the TP group's mirror, `room_state`), as a `RoomSnapshot`. Every wait
is bounded (by the bootstrap or the transfer timeout) and a room that closed ends it
at once with `SendFailed`, saying how it closed.

What this does not know: how the room's KV is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.room_state import RoomSnapshot, RoomWait

# (room, wait seconds, what to wait for) -> the room's state (rank 0: the registry's
# snapshot; ranks above 0: the mirror's)
Snapshot = Callable[[int, float, RoomWait], RoomSnapshot]
POLL_S = 5.0  # one look at the room waits at most this long
ANY_RANK = RoomWait.registered()


class SendFailed(RuntimeError):
    pass


class RoomWaits:
    def __init__(self, snapshot: Snapshot, bootstrap_timeout: float, transfer_timeout: float):
        self.snapshot = snapshot
        self.bootstrap_timeout, self.transfer_timeout = bootstrap_timeout, transfer_timeout

    def state(self, room: int, wait: float, condition: RoomWait) -> RoomSnapshot:
        """The room once `condition` holds, it closed, or `wait` seconds passed."""
        return self.snapshot(room, wait, condition)

    def now(self, room: int) -> RoomSnapshot:
        """The room as it is (any decode rank registered or not)."""
        return self.state(room, 0.0, ANY_RANK)

    def registration(
        self, room: int, decode_rank: int | None, deadline: float
    ) -> proto.Registration:
        """Decode rank `decode_rank`'s registration of `room` (None: whichever comes first).

        Each decode rank is served as soon as it registered: waiting for all of them
        first could deadlock with a rank whose ring is full of this prefill's other rooms.
        """
        condition = RoomWait.registered(decode_rank)
        while True:
            state = self.state(room, max(0.0, min(POLL_S, deadline - time.monotonic())), condition)
            if state.closed:
                raise SendFailed(f"room {room} closed before sending: {state.closed}")
            registrations = state.registrations
            key = next(iter(registrations), None) if decode_rank is None else decode_rank
            if key is not None and key in registrations:
                return registrations[key]
            if time.monotonic() >= deadline:
                who = (
                    "no decode rank" if decode_rank is None else f"decode rank {decode_rank} never"
                )
                raise SendFailed(
                    f"{who} registered room {room} within {self.bootstrap_timeout:g} s"
                )

    def region(self, room: int, decode_rank: int, index: int) -> proto.SegmentRegion:
        """The ring region decode rank `decode_rank` offers for segment `index`."""
        deadline = time.monotonic() + self.transfer_timeout
        condition = RoomWait.offered(decode_rank, index)
        while True:
            state = self.state(room, max(0.0, min(POLL_S, deadline - time.monotonic())), condition)
            if state.closed:
                raise SendFailed(f"room {room} closed while sending: {state.closed}")
            for region in state.registrations[decode_rank].segments:
                if region.index == index:
                    return region
            if time.monotonic() >= deadline:
                raise SendFailed(
                    f"decode rank {decode_rank} offered no ring region for segment {index} of room "
                    f"{room} within {self.transfer_timeout:g} s"
                )

    def closed(self, room: int) -> None:
        """Until the room closed (at most the transfer timeout)."""
        self.state(room, self.transfer_timeout, RoomWait.closed())
