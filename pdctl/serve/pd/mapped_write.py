"""Prefill's mapped write: a room's pages into decode's pool, where the transport maps it.

Where the builtin transport maps decode's device memory here (same host, device
IPC), one launch writes the pages and digests them (`kernels.page_write`). `arm`
does a write's host work (checks, lookups, a CUDA graph's ids in its pinned slot:
a write that comes back the same is a graph's replay, `kernels.page_write.WRITES`);
`ArmedWrite.fire` launches it on the calling thread's current stream; `finish` waits
for it and tells decode where the device did not. `start` is both at once.

The sender arms a room's writes on the engine's thread before the forward that
computes the prompt's last piece is enqueued, when decode registered by then, and
the engine fires them right after enqueuing that forward, on the same thread: they
queue behind it on the device with no host work in between. Where decode offered a
doorbell (same host, `bells`), the launch rings it behind the pages
(`kernels.bell`) and fire announces it (decode looks closely from then on): decode
is told without the host. Otherwise the engine's thread waits for the write and
sends the notification (`finish(inline=True)`) before it chooses the first token
(PDCTL_NOTIFY_AT=token once the token is chosen, PDCTL_NOTIFY_AT=worker from the
room's worker thread, `sender`). A write's time runs on the device's clock from an
event before the launch (it fires when the forward ends) to decode being told: the
event behind the device's ring, or one recorded once the host told decode (on an idle
stream, so it fires at once).

What this does not know: rooms, registrations' arrival, faults.
"""

from __future__ import annotations

import functools
import gc
import io
import logging
import os
import profile
import pstats
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.bells import Ringers
from pdctl.staging import device as dev
from pdctl.staging import held
from pdctl.staging.doorbell import DIGESTS, BellBox, BellRinger, Ticket
from pdctl.staging.kernels import PendingDigests
from pdctl.staging.kernels.page_write import PeerPages, arm_page_write, start_page_write
from pdctl.staging.layout import StagingLayout, plan_segments
from pdctl.staging.mapped import MappedPools
from pdctl.staging.transport import Peer, Transport

log = logging.getLogger("pdctl.serve")
T = TypeVar("T")
P = ParamSpec("P")
EXPLAINED_ROOMS = 12  # rooms whose write parts are logged (what the write time is made of)


def _profiled_count(raw: str) -> int:
    """PDCTL_WRITE_PROFILE=N: the first N enqueues run profiled, then logged."""
    try:
        return max(0, int(raw or "0"))
    except ValueError:
        log.warning("PDCTL_WRITE_PROFILE=%s is not a count of writes: no profile", raw)
        return 0


PROFILED_WRITES = _profiled_count(os.environ.get("PDCTL_WRITE_PROFILE", ""))


class EnqueueProfile:
    """A profile of a writer's first `count` enqueues, on the thread that runs them;
    once they ran, the functions that took the most time are logged (where the host's
    enqueue time goes inside a server, which a standalone profile does not show).

    The pure-Python profiler (`profile`, through sys.setprofile) sees only the calling
    thread. cProfile would be cheaper, but from Python 3.12 it profiles every thread of
    the process (sys.monitoring is process-wide): the HTTP side's sleeps and compiles
    would fill the report. Its per-call overhead inflates call-heavy code; read the
    shares, not the absolute times."""

    def __init__(self, count: int, lines: int = 30) -> None:
        self.left, self.lines = count, lines
        self.stats: pstats.Stats | None = None

    def run(self, function: Callable[[], T]) -> T:
        if not self.left:
            return function()
        profiler = profile.Profile()
        try:
            return profiler.runcall(function)
        finally:
            self.left -= 1
            if self.stats is None:
                self.stats = pstats.Stats(profiler)
            else:
                self.stats.add(profiler)
            if self.left == 0:
                log.info("mapped write enqueue profile:\n%s", self.report())

    def report(self) -> str:
        assert self.stats is not None
        out = io.StringIO()
        self.stats.stream = out  # type: ignore[attr-defined]
        self.stats.sort_stats("tottime").print_stats(self.lines)
        return out.getvalue()


@dataclass(frozen=True)
class EnqueueParts:
    """Where the host's time to enqueue a write went (seconds)."""

    host: float  # in all
    run: float  # of which this thread ran (the rest it waited: the GIL, the OS)
    before_launch: float  # armed (lookups, checks, the ids in place), before the launch
    collecting: float  # this thread's garbage collections meanwhile


class GcClock:
    """Seconds each thread spent in the garbage collector (a `gc.callbacks` entry,
    installed once): what a Python collection adds to a write's host time."""

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        self._spent: dict[int, float] = {}
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            self._installed = True
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = time.perf_counter()
        elif thread in self._started:
            spent = time.perf_counter() - self._started.pop(thread)
            self._spent[thread] = self._spent.get(thread, 0.0) + spent

    def seconds(self) -> float:
        """This thread's seconds in collections so far."""
        return self._spent.get(threading.get_ident(), 0.0)


GC = GcClock()


@dataclass
class StartedWrite:
    """One decode rank's mapped write, enqueued (`ArmedWrite.fire`)."""

    room: int
    peer: Peer
    pending: PendingDigests
    began: Any  # device event before the launch (timing)
    ended: Any  # device event after it
    nbytes: int
    parts: EnqueueParts  # the host's enqueue
    bell: RoomBell | None = None  # where decode hears of it (None: a notification)
    done_s: float | None = None  # the write's seconds, once `finish` sent its notification

    @property
    def rang(self) -> bool:
        """The launch itself rang decode's doorbell: nothing is left to tell it."""
        return self.bell is not None and self.pending.rung


@dataclass(frozen=True)
class RoomWrite:
    """One prefill rank's direct write of a room to one decode rank: the room's pages,
    decode's registration, the layout of its slices, this rank's writer index in it,
    and decode's endpoint (what every direct path is given)."""

    room: int
    pages: list[int]
    reg: proto.Registration
    layout: StagingLayout
    writer: int
    peer: Peer


@dataclass(frozen=True)
class RoomBell:
    """A write's doorbell: decode's box opened here, the ticket, and the slot's address
    for the device (None: the host rings once the write landed)."""

    ringer: BellRinger
    ticket: Ticket
    device_slot: int | None


@dataclass
class ArmedWrite:
    """A mapped write whose host work is done (`MappedWriter.arm`): `fire` enqueues it
    on the calling thread's current stream, right behind the forward it follows."""

    room: int
    peer: Peer
    launch: Callable[[], PendingDigests]
    nbytes: int
    bell: RoomBell | None
    device: torch.device
    host_s: float  # the arm's host seconds
    run_s: float  # of which this thread ran
    collecting_s: float

    def fire(self) -> StartedWrite:
        began_s, began_cpu, began_gc = time.perf_counter(), time.thread_time(), GC.seconds()
        stream = dev.current_device_stream(self.device)
        began, ended = _timing_event(self.device), _timing_event(self.device)
        began.record(stream)
        pending = self.launch()
        if not pending.rung:
            pending.stage_to_host()  # the digests reach pinned host memory behind the write
        ended.record(stream)
        ended_s = time.perf_counter()
        parts = EnqueueParts(
            self.host_s + ended_s - began_s, self.run_s + time.thread_time() - began_cpu,
            self.host_s, self.collecting_s + GC.seconds() - began_gc,
        )  # fmt: skip
        started = StartedWrite(
            self.room, self.peer, pending, began, ended, self.nbytes, parts, self.bell
        )
        if started.rang and self.bell is not None:
            self.bell.ringer.announce(self.bell.ticket)  # decode looks closely from now on
        return started


def _profiled(
    method: Callable[Concatenate[MappedWriter, P], T],
) -> Callable[Concatenate[MappedWriter, P], T]:
    """The method run under its writer's `EnqueueProfile`."""

    @functools.wraps(method)
    def run(self: MappedWriter, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.profile.run(functools.partial(method, self, *args, **kwargs))

    return run


class MappedWriter:
    def __init__(self, rank: int, kv: KVPool, transport: Transport) -> None:
        self.rank, self.kv, self.transport = rank, kv, transport
        self.pools = MappedPools(transport)  # decode pools this transport maps here
        self.ringers = Ringers()  # decode doorbell boxes opened here
        self.explained = 0
        self.profile = EnqueueProfile(PROFILED_WRITES)
        GC.install()

    def warm(self) -> None:
        """Compile the write's kernels now, before any request pays for it (Triton's
        compile took 408 ms of a first request on a host with an empty cache): the
        pages of this pool's scratch page written onto themselves, digested, and a
        doorbell box of this process rung from the device. Equal TP's slice (every
        head) is the one warmed; a failure is logged, and the first write compiles."""
        first = self.kv.k_buffers[0]
        if first.device.type != "cuda":
            return
        try:
            with BellBox(1, 2 * len(self.kv.k_buffers)) as box, BellRinger(box.info) as ringer:
                ticket = box.ticket()
                assert ticket is not None
                address = ringer.device_slot(ticket.slot, first.device)
                scratch = self.kv.scratch_row // self.kv.page_size
                own = [b for pair in zip(self.kv.k_buffers, self.kv.v_buffers, strict=True)
                       for b in pair]  # fmt: skip
                pending = start_page_write(
                    self.kv.k_buffers, self.kv.v_buffers, [scratch],
                    PeerPages(own, [scratch], 0), [(0, 1)], head_start=0,
                    num_heads=first.shape[1], page_size=self.kv.page_size,
                    bell=None if address is None else (address, ticket.seq),
                )  # fmt: skip
                pending.result()
                if pending.rung and box.wait(ticket, 5.0) is None:
                    log.warning("the doorbell warm-up rang nothing: device rings may not arrive")
        except Exception:
            log.exception(
                "the mapped write's kernels could not be warmed: the first write compiles"
            )

    def start(self, write: RoomWrite) -> StartedWrite | None:
        """Enqueue the write on the current stream now (`arm`, then `fire`)."""
        armed = self.arm(write)
        return None if armed is None else armed.fire()

    @_profiled
    def arm(self, write: RoomWrite) -> ArmedWrite | None:
        """The write's host work, up to its launch (None: decode's pool is not mapped
        here, or its rows differ from ours; the caller writes by descriptors). The
        first PROFILED_WRITES run under the writer's profile."""
        began_s, began_cpu, began_gc = time.perf_counter(), time.thread_time(), GC.seconds()
        reg, layout, pages = write.reg, write.layout, write.pages
        first = self.kv.k_buffers[0]
        if reg.head_dim != first.shape[2] or reg.elem_bytes != first.element_size():
            return None
        bases = [address for pair in reg.kv_bases for address in pair]
        buffers = self.pools.buffers(write.peer, bases, reg.kv_heads, reg.head_dim, first)
        if buffers is None:
            return None
        plan = plan_segments(
            len(pages), self.kv.page_size, layout.bytes_per_token(), reg.segment_bytes
        )
        piece = layout.slices[write.writer]
        bell = self._bell(reg, write.writer, first.device)
        device_bell = None
        if bell is not None and bell.device_slot is not None:
            device_bell = (bell.device_slot, bell.ticket.seq)
        launch = arm_page_write(
            self.kv.k_buffers, self.kv.v_buffers, pages,
            PeerPages(buffers, reg.pages, piece.dst_head_start),
            [(segment.page_start, segment.num_pages) for segment in plan],
            head_start=piece.src_head_start, num_heads=piece.num_heads,
            page_size=self.kv.page_size, bell=device_bell,
        )  # fmt: skip
        nbytes = layout.block_bytes(write.writer, len(pages) * self.kv.page_size)
        return ArmedWrite(
            write.room, write.peer, launch, nbytes, bell, first.device,
            time.perf_counter() - began_s,
            time.thread_time() - began_cpu, GC.seconds() - began_gc,
        )  # fmt: skip

    def _bell(self, reg: proto.Registration, writer: int, device: torch.device) -> RoomBell | None:
        """This writer's doorbell where decode offered one and its box opens here."""
        found = self.ringers.ticket(reg, writer)
        if found is None:
            return None
        ringer, ticket = found
        return RoomBell(ringer, ticket, ringer.device_slot(ticket.slot, device))

    def finish(self, started: StartedWrite, *, inline: bool = False) -> float:
        """Wait for the write; tell decode unless the device rang its doorbell (the host
        rings it, or sends the notification); returns the write's seconds (also kept
        in `started.done_s`).

        The seconds run on the device's clock from the event before the launch (the
        forward's end, when the write queued behind it; the launch's own host work
        when it went onto an idle stream) to the later of the event after the launch
        (where the device rang) and one recorded on the calling thread's stream once
        decode was told from here. That stream is idle then (inline: the engine's,
        once the first token is chosen; else a worker's own), so the event fires at
        once and every host step in between counts, the worker's wake-up included.
        inline only names the caller in the log."""
        started.ended.synchronize()  # the bytes are in decode's pool
        began_s, began_cpu = time.perf_counter(), time.thread_time()
        bell = started.bell
        device = self.kv.k_buffers[0].device
        if started.rang:
            told = started.ended  # the device rang behind the write
        else:
            digests = [d for part in started.pending.result() for d in part]
            if bell is not None:
                bell.ringer.ring(bell.ticket, DIGESTS, digests)
            else:
                notice = proto.notify_message(
                    started.room, proto.DIRECT_SEGMENT, self.rank, digests, started.nbytes
                )
                self.transport.notify(started.peer, notice)
            told = _timing_event(device)
            told.record(dev.current_device_stream(device))
            told.synchronize()
        finish_s, finish_cpu = time.perf_counter() - began_s, time.thread_time() - began_cpu
        seconds = started.began.elapsed_time(told) / 1e3
        device_s = started.began.elapsed_time(started.ended) / 1e3
        self._explain(started, inline, device_s, finish_s, finish_cpu, seconds)
        started.done_s = seconds
        return seconds

    def _explain(
        self,
        started: StartedWrite,
        inline: bool,
        device_s: float,
        finish_s: float,
        finish_cpu: float,
        seconds: float,
    ) -> None:
        """The parts of the first rooms' writes, logged (what the write time is made of)."""
        if self.explained >= EXPLAINED_ROOMS:
            return
        self.explained += 1
        parts = started.parts
        told = "doorbell (device)" if started.rang else (
            "doorbell (host)" if started.bell else "notification"
        )  # fmt: skip
        log.info(
            "room %s: mapped write%s: enqueue %.0f us (host; %.0f us run by this thread, "
            "%.0f us armed before, %.0f us collecting garbage), first to last event "
            "%.0f us (device), %s %.0f us (host; %.0f us run), the write's time %.0f us",
            started.room, " (engine thread)" if inline else "", parts.host * 1e6,
            parts.run * 1e6, parts.before_launch * 1e6, parts.collecting * 1e6,
            device_s * 1e6, told, finish_s * 1e6, finish_cpu * 1e6, seconds * 1e6,
        )  # fmt: skip


def _timing_event(device: torch.device) -> Any:
    """A timing event; on CUDA one whose record keeps the GIL (`staging.held`)."""
    event = held.held_event(device)
    if event is not None:
        return event
    return dev.create_device_event(device, timing=True)
