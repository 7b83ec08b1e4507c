"""Prefill side, per TP rank: send a room's KV to every decode rank that needs it.

Each room is sent on its own worker thread, so a room waiting for decode to offer
a ring region never holds up another room whose region is already there (decode
may hold regions for rooms in another order than prefill finishes them).

For each decode rank this prefill rank writes to (`targets`), the room goes the way
decode registered it (`writes.KvWrite`, by the registration's mode, the ways built
once here): staged through decode's ring (`staged`), or direct into decode's pool
(`direct`: the mapped write where the transport maps that pool here, else by
descriptors). When decode registered in time and its pool is mapped here, the mapped
write is armed before the forward computing the prompt's last piece is enqueued
(`arm`) and fired right behind it on the thread that enqueued it (`early`); the
room's worker finishes it. A room's faults (`RoomFaults`) are drawn once and wrap its
writes (`write_faults`); they travel with its clock as one `early.RoomJob`. Failures
are reported with the decode rank they concern.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd.client import PeerCallError
from pdctl.serve.pd.direct import DescribedWrite, DirectWrite
from pdctl.serve.pd.early import EarlyWrites, RoomJob, settle
from pdctl.serve.pd.mapped_write import NOOP, MappedWriter, WriteObserver
from pdctl.serve.pd.reports import RankReport, Report
from pdctl.serve.pd.staged import StagedWrite, StagingBuffers
from pdctl.serve.pd.targets import Targets
from pdctl.serve.pd.waits import RoomWaits, SendFailed, Snapshot
from pdctl.serve.pd.write_faults import RoomWays
from pdctl.serve.pd.writes import Link, RoomWrite, SendClock
from pdctl.staging import device as dev
from pdctl.staging.transport import Transport, TransportError

__all__ = ["KVSender", "SendFailed", "Snapshot"]
log = logging.getLogger("pdctl.serve")


@dataclass(frozen=True)
class SendStats:
    """What one rank's send of a room did; write_ms: gathering, digests and writes only
    (not waiting for decode's regions)."""

    nbytes: int
    segments: int
    write_ms: float
    gather_ms: float
    digest_ms: float

    @staticmethod
    def of(nbytes: int, segments: int, busy_s: float, clock: SendClock) -> SendStats:
        ms = [round(seconds * 1e3, 3) for seconds in (busy_s, clock.gather, clock.digest)]
        return SendStats(nbytes, segments, *ms)

    def report(self, rank: int, transfer_ms: float) -> RankReport:
        """Rank `rank`'s report of the room, which took `transfer_ms` in all."""
        return RankReport(
            rank,
            True,
            bytes=self.nbytes,
            segments=self.segments,
            transfer_ms=transfer_ms,
            write_ms=self.write_ms,
            gather_ms=self.gather_ms,
            digest_ms=self.digest_ms,
        )


class KVSender:
    def __init__(
        self,
        *,
        rank: int,
        tp: int,
        num_kv_heads: int,
        kv: KVPool,
        transport: Transport,
        snapshot: Snapshot,
        report: Report,
        segment_bytes: int,
        bootstrap_timeout: float,
        transfer_timeout: float,
        workers: int = 32,
        buffers: int = 2,
        bells: bool = True,
        notify_at: str = "write",
        observer: WriteObserver = NOOP,
    ) -> None:
        self.rank, self.kv, self.transport, self.report = rank, kv, transport, report
        self.waits = RoomWaits(snapshot, bootstrap_timeout, transfer_timeout)
        self.targets = Targets(rank, tp, num_kv_heads, kv, transport)
        staging = StagingBuffers(transport, segment_bytes, buffers, kv.kv.device)
        transport.register_tensor(kv.kv)  # direct page writes read the pool itself
        self.mapped = MappedWriter(rank, kv, transport, bells=bells, observer=observer)
        if transport.RINGS_BELLS:  # same-host device writes are mapped writes: compile them now
            self.mapped.warm()
        staged = StagedWrite(rank, kv, staging, self.waits)
        direct = DirectWrite(self.mapped, DescribedWrite(rank, kv, self.mapped.ringers))
        self.ways = RoomWays.around(staged, direct, staging, self.waits)  # faults wrap them
        self.early = EarlyWrites(self.mapped, self.waits, self.targets, self.ways.draw, notify_at)
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix=f"pdctl-send-{rank}")
        self._local = threading.local()

    def arm(self, room: int, pages: list[int]) -> Callable[[], None] | None:
        """The next forward computes `room`'s last prompt piece (engine's thread, before
        it is enqueued). Where decode already registered and its pool is mapped here,
        the writes' host work is done now and the function returned launches them; the
        engine runs it right after enqueuing that forward, on the same thread, so they
        queue behind it on the device with nothing in between (`early`)."""
        return self.early.arm(room, pages)

    def prepare(self, room: int, pages: list[int]) -> None:
        """The forward computing `room`'s last prompt piece is enqueued (not done), on the
        engine's thread: writes not armed before start now; with notify_at "write" those
        decode hears by message are notified before the first token is chosen."""
        self.early.prepare(room, pages)

    def send(self, room: int, pages: list[int], num_tokens: int, ready: Any) -> None:
        """Start sending `room` (pages hold the prompt's KV once `ready` completes).

        Called right after the forward (rank 0: on the engine's thread, once the first
        token is chosen). Early writes that landed are notified here (`early.take`); a
        worker finishes them and writes the rest."""
        job = self.early.take(room, pages)
        self.executor.submit(self._run, room, pages, num_tokens, ready, job)

    def forget(self, room: int) -> None:
        """`room` ended before `send` (aborted): its prepared job is dropped, and a write
        it launched already is waited for (decode's memory stays fenced until then)."""
        self.early.forget(room)

    def _stream(self) -> Any:
        """This worker thread's own stream: a room's gathers and digests never queue
        behind the engine's next forward on the default stream."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = dev.create_device_stream(self.kv.kv.device)
        return stream

    def _run(
        self, room: int, pages: list[int], num_tokens: int, ready: Any, job: RoomJob | None
    ) -> None:
        started = time.monotonic()
        try:
            # The pages hold the prompt's KV once `ready` completed (the engine sampled
            # the first token, so it usually has): the transport's own streams read them.
            ready.synchronize()
            with dev.device_stream_context(self._stream()):
                stats = self._send(room, pages, job)
            transfer_ms = round((time.monotonic() - started) * 1e3, 3)
            self.report(room, stats.report(self.rank, transfer_ms))
        except (SendFailed, TransportError, PeerCallError) as exc:
            log.warning("room %s: %s", room, exc)
            settle(room, job)  # reported ended: nothing of it may still be landing
            self.report(room, RankReport(self.rank, False, str(exc)))
        except Exception as exc:  # a bug must still fail the room, not hang it
            log.exception("room %s: send failed", room)
            settle(room, job)
            self.report(room, RankReport(self.rank, False, f"prefill rank {self.rank}: {exc}"))

    def _send(self, room: int, pages: list[int], job: RoomJob | None) -> SendStats:
        deadline = time.monotonic() + self.waits.bootstrap_timeout
        decode_tp = self.waits.registration(room, None, deadline).decode_tp
        if job is None:
            job = RoomJob(self.ways.draw(room))
        ways = self.ways.enter(job.faults)
        total, segments, busy = 0, 0, 0.0
        for decode_rank, layout, writer in self.targets.of(decode_tp):
            early = job.early.get(decode_rank)
            if early is not None:  # enqueued behind the forward: wait, notify (if not yet)
                busy += early.done_s if early.done_s is not None else self.mapped.finish(early)
                total += early.nbytes
                continue
            reg = self.waits.registration(room, decode_rank, deadline)
            # decode's row shape, as it registered
            layout = dataclasses.replace(layout, head_dim=reg.head_dim, elem_bytes=reg.elem_bytes)
            started = time.perf_counter()
            target = RoomWrite(room, pages, reg, layout, writer, self.targets.peer(reg))
            written = ways[reg.mode].write(target, Link(self.transport, target.peer), job.clock)
            busy += time.perf_counter() - started - written.waited_s
            total, segments = total + written.nbytes, segments + written.segments
        return SendStats.of(total, segments, busy, job.clock)
