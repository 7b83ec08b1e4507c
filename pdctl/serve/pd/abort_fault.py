"""Decode's `abort-transfer` fault: give a room up while prefill's write to it is in flight.

A room the fault picks (`Faults.aborts`, by the room's id) is aborted once prefill
computed its prompt (its first token is on the bootstrap endpoint: the sender is
about to write), in turn one of two ways: as a client gone (the engine aborts the
request, as a closed connection does) or as a failed receive (decode rank 0's
receiver gives the room up, as on a timeout or a bad digest). Prefill picks the same
rooms and lands their writes after the room closed (`RoomFaults.late_write_s`), so the
late write a fence must wait for is really there. Off unless the topology's faults ask.

What this does not know: pages, rings, fences; it only ends rooms the way the world
ends them.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from pdctl.serve.faults import Faults
from pdctl.serve.pd.client import PeerCallError
from pdctl.serve.pd.receiver import KVReceiver

log = logging.getLogger("pdctl.serve")
RESULT_WAIT_S = 30.0  # at most this long for prefill's first token before the abort
GONE = "abort-transfer fault: the client is gone"
GAVE_UP = "abort-transfer fault: decode gave the room up"


class Aborter(Protocol):
    def abort(self, rid: str) -> None: ...


class AbortTransfers:
    """Decode rank 0: aborts the rooms the fault picks, each on a thread of its own."""

    def __init__(self, source: Faults, receiver: KVReceiver) -> None:
        self.source, self.receiver = source, receiver
        # few: each waits on prefill's bootstrap, whose long polls share a small thread pool
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="pdctl-abort-fault")
        self._turn = itertools.count()

    @staticmethod
    def wanted(source: Faults) -> bool:
        return "abort-transfer" in source.specs

    def admitted(self, engine: Aborter, rid: str, room: int, bootstrap: str) -> None:
        """A room was admitted (its pages reserved): abort it soon if the fault picks it."""
        if self.source.aborts(room) is not None:
            self.executor.submit(self._abort, engine, rid, room, bootstrap, next(self._turn))

    def _abort(self, engine: Aborter, rid: str, room: int, bootstrap: str, turn: int) -> None:
        try:  # prefill computed the prompt: its sender is writing, or about to
            self.receiver.client(bootstrap).call(
                "GET", f"/bootstrap/result/{room}", params={"wait": RESULT_WAIT_S}
            )
        except PeerCallError as exc:
            log.info("room %s: abort-transfer: prefill's result: %s", room, exc)
        reason = GONE if turn % 2 == 0 else GAVE_UP
        log.warning("injecting fault abort-transfer: room %s (%s)", room, reason)
        self.receiver.abort(room, reason)
        if reason == GONE:
            engine.abort(rid)
