"""Decode's fence: memory given up mid-transfer is held until no writer can touch it.

A room decode gives up before every writer notified (the client gone, a timeout, a
failed receive, prefill's failure) leaves memory prefill may still be writing: the
request's KV pages (rank 0's engine keeps them, `Scheduler.fence`) and, on each rank,
the ring regions it offered and did not land (`DecodeStagingHandler.close_room(
fence=True)`). NIXL's, Mooncake's and the builtin transport's same-host writes are
one-sided: nothing on decode sees them land, so nothing here could refuse one. So
each such room is handed to a `Fence` with what releases it, and the fence asks
prefill's bootstrap endpoint (`/bootstrap/fence`) to close the room and say once it
is quiet: every prefill rank's sender of it ended (they report only after their
writes completed), or it never started and never will. Only then is the memory given
back.

Bounded. A prefill whose process is gone writes nothing more: its pidfd (a prefill on
this host, opened while it was known alive) or, elsewhere, a refused connection says
so, and its rooms are released with a log line naming it. A prefill alive that never
confirms is released after `bound_s` (longer than any send of prefill can last) with
an error naming it, and counted (`unconfirmed`, which `ServerInfo.leaks` reports):
a late write could then land in reused memory.

What it does not know: what it releases (pages, regions: callables), or the engine.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pdctl.serve.pd.client import Client, PeerCallError
from pdctl.serve.pd.protocol import ProcessIdentity

log = logging.getLogger("pdctl.serve")
POLL_S = 0.5  # one fence call waits at most this long for a room to turn quiet
RETRY_S = 0.1  # after a call that failed, before the next


def my_identity() -> ProcessIdentity:
    """This process's pid and its host's boot id: a peer on the same host can watch its
    end (a pidfd) where the boot ids match."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = None
    return ProcessIdentity(os.getpid(), boot_id)


def process_identity() -> dict[str, int | str | None]:
    """`my_identity` as JSON (prefill's `/bootstrap/info` carries it)."""
    return my_identity().to_json()


class WriterLiveness:
    """Whether a prefill (by bootstrap address) is gone: its pidfd where it runs on this
    host, else a refused connection."""

    def __init__(self) -> None:
        self.mine = my_identity().boot_id
        self._pidfds: dict[str, int | None] = {}
        self._lock = threading.Lock()

    def watch(self, address: str, process: ProcessIdentity) -> None:
        """Prefill's process, from its `/bootstrap/info` just fetched (so its pid is its
        own now)."""
        pid = process.pid
        with self._lock:
            if address in self._pidfds or pid is None or pid <= 0:
                return
            same_host = self.mine is not None and process.boot_id == self.mine
            try:
                self._pidfds[address] = os.pidfd_open(pid) if same_host else None
            except (OSError, AttributeError):  # gone already, or no pidfds here
                self._pidfds[address] = None

    def gone(self, address: str, error: PeerCallError) -> bool:
        with self._lock:
            pidfd = self._pidfds.get(address)
        if pidfd is not None:
            return bool(select.select([pidfd], [], [], 0)[0])  # readable once it exited
        return error.refused


@dataclass
class Fenced:
    room: int
    bootstrap: str
    reason: str  # why decode gave the room up (prefill closes it with this)
    releases: list[Callable[[], object]] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)


class Fence:
    """One decode rank's rooms held for their writers, and the thread that asks."""

    def __init__(self, name: str, client: Callable[[str], Client], bound_s: float) -> None:
        self.name, self.client, self.bound_s = name, client, bound_s
        self.liveness = WriterLiveness()
        self.counts = {"released": 0, "writer_gone": 0, "unconfirmed": 0}
        self._rooms: dict[int, Fenced] = {}
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="pdctl-fence", daemon=True)
        self._thread.start()

    def add(self, room: int, bootstrap: str, reason: str, release: Callable[[], object]) -> None:
        """Hold `room` until its writers stopped, then call `release` (on the fence's
        thread). A room held already gets one more release."""
        with self._wake:
            held = self._rooms.setdefault(room, Fenced(room, bootstrap, reason))
            held.releases.append(release)
            self._wake.notify()

    def rooms(self) -> set[int]:
        with self._wake:
            return set(self._rooms)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._rooms:
                    self._wake.wait()
                by_peer: dict[str, list[Fenced]] = {}
                for held in self._rooms.values():
                    by_peer.setdefault(held.bootstrap, []).append(held)
            for bootstrap, rooms in by_peer.items():
                self._ask(bootstrap, rooms, POLL_S / len(by_peer))
            self._expire()

    def _ask(self, bootstrap: str, rooms: list[Fenced], wait: float) -> None:
        body = {"rooms": [{"room": h.room, "reason": h.reason} for h in rooms], "wait": wait}
        try:
            answer = self.client(bootstrap).call(
                "POST", "/bootstrap/fence", json=body, timeout=wait + 10.0
            )
        except PeerCallError as exc:
            if self.liveness.gone(bootstrap, exc):
                log.warning(
                    "%s: prefill %s is gone (%s): it writes nothing more; the memory of "
                    "%d fenced rooms goes back",
                    self.name,
                    bootstrap,
                    exc,
                    len(rooms),
                )
                self._release(rooms, "writer_gone")
            else:
                time.sleep(RETRY_S)
            return
        quiet = set(answer.get("quiet") or [])
        self._release([h for h in rooms if h.room in quiet], "released")

    def _expire(self) -> None:
        now = time.monotonic()
        with self._wake:
            late = [h for h in self._rooms.values() if now - h.since > self.bound_s]
        for held in late:
            log.error(
                "%s: room %s: prefill %s did not confirm within %g s that its senders "
                "stopped; the room's memory goes back unconfirmed (a late write could land "
                "in memory handed out since)",
                self.name,
                held.room,
                held.bootstrap,
                self.bound_s,
            )
        self._release(late, "unconfirmed")

    def _release(self, rooms: Iterable[Fenced], how: str) -> None:
        for held in rooms:
            with self._wake:
                if self._rooms.get(held.room) is not held:
                    continue
                del self._rooms[held.room]
                self.counts[how] += 1
            for release in held.releases:
                try:
                    release()
                except Exception:
                    log.exception("%s: room %s: releasing its fenced memory", self.name, held.room)
