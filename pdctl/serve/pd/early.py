"""Prefill's early writes: a room's mapped writes launched behind the forward that
completes its prompt, on the engine's thread, and when decode hears of them.

`arm` (before that forward is enqueued) does the writes' host work where decode
already registered and its pool is mapped here; the engine fires what it returns
right after enqueuing the forward. `prepare` (the forward enqueued) fires writes that
could only start now, and with `notify_at` "write" waits for those decode hears by
message and notifies before the first token is chosen; `take` (once the token is
chosen: the room's send starts) notifies the landed ones unless `notify_at` is
"worker", and hands the room's `RoomJob` to its worker, which finishes the rest. A
write whose doorbell the device rang needs nothing more on the host. A room that
ended first is `forget`-ed: nothing armed fires, and a write launched already is
waited for (decode's memory stays fenced until then).

What this does not know: staged writes, descriptors, reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pdctl.serve.faults import RoomFaults
from pdctl.serve.pd.mapped_write import ArmedWrite, MappedWriter, StartedWrite
from pdctl.serve.pd.targets import Targets
from pdctl.serve.pd.waits import RoomWaits
from pdctl.serve.pd.writes import RoomWrite, SendClock

log = logging.getLogger("pdctl.serve")
# Where an early write's notification goes out: "write", on the engine's thread as soon
# as the write landed (before the first token is chosen, so decode checks its pages
# while prefill samples); "token", on the engine's thread once the token is chosen;
# "worker", from the room's worker thread.
NOTICES = ("write", "token", "worker")


@dataclass
class RoomJob:
    """One room's send: the faults drawn for it (once) and the clock of its work."""

    faults: RoomFaults = field(default_factory=RoomFaults)
    clock: SendClock = field(default_factory=SendClock)
    armed: dict[int, ArmedWrite] = field(default_factory=dict)  # decode rank -> to fire
    early: dict[int, StartedWrite] = field(default_factory=dict)  # decode rank -> started
    forgotten: bool = False  # the room ended first: nothing armed fires any more
    lock: threading.Lock = field(default_factory=threading.Lock)  # fire against forget


class EarlyWrites:
    """One prefill rank's early writes, room by room (`arm`, `prepare`, `take`, `forget`)."""

    def __init__(
        self,
        mapped: MappedWriter,
        waits: RoomWaits,
        targets: Targets,
        draw_faults: Callable[[int], RoomFaults],
        notify_at: str = "write",
    ) -> None:
        if notify_at not in NOTICES:
            raise ValueError(f"notify_at {notify_at!r} is not one of {', '.join(NOTICES)}")
        self.mapped, self.waits, self.targets = mapped, waits, targets
        self.draw_faults = draw_faults
        # where landed writes are notified, chosen once: `prepare` waits for them and
        # notifies ("write"), `take` notifies those landed ("write", "token"), else the
        # room's worker does ("worker")
        self.notify_on_prepare = notify_at == "write"
        self.notify_on_take = notify_at != "worker"
        self._said = False  # logged once: writes enqueued on the engine's thread
        self._prepared: dict[int, RoomJob | None] = {}  # room -> its job (`prepare`)

    def arm(self, room: int, pages: list[int]) -> Callable[[], None] | None:
        """The writes' host work now, where decode registered and its pool is mapped
        here; the function returned launches them on the caller's stream."""
        job = self._try(room, pages, fire=False)
        if job is None:
            return None
        self._prepared[room] = job
        return (lambda: self._fire(room, job)) if job.armed else None

    def prepare(self, room: int, pages: list[int]) -> None:
        """The forward computing `room`'s last prompt piece is enqueued (not done)."""
        job = self._prepared.get(room)
        if job is None:
            job = self._prepared[room] = self._try(room, pages, fire=True)
        if job is not None and self.notify_on_prepare:
            self._notify_landed(room, job, wait=True)

    def take(self, room: int, pages: list[int]) -> RoomJob | None:
        """The room's job for its worker (None: decode had not registered), its landed
        writes notified here unless `notify_at` is "worker"."""
        job = self._prepared.pop(room, None) or self._try(room, pages, fire=True)
        if job is not None and self.notify_on_take:
            self._notify_landed(room, job)
        return job

    def forget(self, room: int) -> None:
        job = self._prepared.pop(room, None)
        if job is not None:
            with job.lock:
                job.forgotten = True
            settle(room, job)

    def _try(self, room: int, pages: list[int], *, fire: bool) -> RoomJob | None:
        try:
            job = self._arm(room, pages)
        except Exception:  # the worker sends the room its usual way; the engine goes on
            log.exception("room %s: an early write could not start", room)
            return None
        if job is not None and fire:
            self._fire(room, job)
        return job

    def _fire(self, room: int, job: RoomJob) -> None:
        """Launch the armed writes on this thread's stream (a failure leaves that decode
        rank to the worker, which writes it by descriptors)."""
        with job.lock:
            for decode_rank, armed in list(job.armed.items()) if not job.forgotten else []:
                try:
                    job.early[decode_rank] = armed.fire()
                except Exception:
                    log.exception("room %s: decode rank %s: the mapped write", room, decode_rank)
            job.armed.clear()

    def _notify_landed(self, room: int, job: RoomJob, wait: bool = False) -> None:
        """Notify the early writes the stream has passed (wait: every one, once it
        landed), on the caller's thread; a failure leaves the write to the worker,
        which reports it. Writes whose doorbell the device rang are left to the worker
        (it only times them)."""
        for decode_rank, started in job.early.items():
            if started.rang or started.done_s is not None or not (wait or started.ended.query()):
                continue
            try:
                self.mapped.finish(started, inline=True)
            except Exception:
                log.exception("room %s: decode rank %s: the notification failed", room, decode_rank)

    def _arm(self, room: int, pages: list[int]) -> RoomJob | None:
        state = self.waits.now(room)
        registrations = state.registrations
        if state.closed or not registrations:
            return None  # not yet registered: the worker waits for decode
        decode_tp = next(iter(registrations.values())).decode_tp
        ready = []  # decode ranks registered, direct, their transport connected before
        for decode_rank, layout, writer in self.targets.of(decode_tp):
            reg = registrations.get(decode_rank)
            peer = None if reg is None else self.targets.connected(reg.transport)
            if reg is not None and reg.mode == "direct" and peer is not None:
                ready.append(RoomWrite(room, pages, reg, layout, writer, peer))
        # decode registered: the room's faults are drawn now, once (the worker keeps them)
        job = RoomJob(self.draw_faults(room))
        if job.faults != RoomFaults():
            return job  # faults go the worker's way
        for write in ready:
            decode_rank = write.reg.decode_rank
            try:
                armed = self.mapped.arm(write)
            except Exception:  # the worker writes this rank by descriptors and reports
                log.exception(
                    "room %s: decode rank %s: the mapped write did not start", room, decode_rank
                )
                continue
            if armed is not None:
                job.armed[decode_rank] = armed
        if job.armed and not self._said:
            self._said = True
            log.info("room %s: KV writes start behind the forward (decode pool mapped)", room)
        return job


def settle(room: int, job: RoomJob | None) -> None:
    """Every early write of the job has landed (before the room is reported ended)."""
    for decode_rank, started in (job.early if job is not None else {}).items():
        try:
            started.ended.synchronize()
        except Exception:
            log.exception("room %s: decode rank %s: the mapped write", room, decode_rank)
