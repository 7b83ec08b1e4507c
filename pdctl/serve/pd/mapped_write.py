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
(or where the sender's `notify_at` says, `early`). How decode is told is the write's
`notice.Notice`, chosen once when it is armed. A write's time runs on the
device's clock from an event before the launch (it fires when the forward ends) to
decode being told: the event behind the device's ring, or one recorded once the host
told decode (on an idle stream, so it fires at once).

Measurement attaches from outside: a `WriteObserver` given to the writer runs the arm
and the launch and hears each finished write (`NOOP` does nothing; a benchmark's
observer profiles and times them, benchmarks/pd_write_observer.py).

What this does not know: rooms, registrations' arrival, faults.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeVar

import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd.bells import Ringers
from pdctl.serve.pd.notice import Notice, notice_for
from pdctl.serve.pd.writes import Link, RoomWrite
from pdctl.staging import device as dev
from pdctl.staging import held
from pdctl.staging.doorbell import BellBox, BellRinger
from pdctl.staging.kernels import PendingDigests
from pdctl.staging.kernels.page_write import PeerPages, arm_slice_write, start_slice_write
from pdctl.staging.layout import KVSlice, plan_segments
from pdctl.staging.mapped import MappedPools
from pdctl.staging.transport import Transport

log = logging.getLogger("pdctl.serve")
T = TypeVar("T")


class WriteObserver:
    """Hooks on a writer's path, each a no-op here (`NOOP`): `arming` and `firing` run
    the arm and the launch (a profiler or a clock wraps them), `finished` hears each
    write once decode was told (how: "doorbell (device)", "doorbell (host)" or
    "notification"; the device's seconds of the launch, the host's of the finish, the
    write's time). An observer overrides what it needs."""

    def arming(self, arm: Callable[[], T]) -> T:
        return arm()

    def firing(self, fire: Callable[[], T]) -> T:
        return fire()

    def finished(
        self,
        started: StartedWrite,
        told: str,
        inline: bool,
        device_s: float,
        finish_s: float,
        seconds: float,
    ) -> None:
        pass


NOOP = WriteObserver()


@dataclass
class StartedWrite:
    """One decode rank's mapped write, enqueued (`ArmedWrite.fire`)."""

    room: int
    link: Link  # decode's endpoint
    pending: PendingDigests
    began: Any  # device event before the launch (timing)
    ended: Any  # device event after it
    nbytes: int
    notice: Notice  # how decode hears of it, where the launch did not ring
    done_s: float | None = None  # the write's seconds, once `finish` sent its notification

    @property
    def rang(self) -> bool:
        """The launch itself rang decode's doorbell: nothing is left to tell it."""
        return self.pending.rung


@dataclass
class ArmedWrite:
    """A mapped write whose host work is done (`MappedWriter.arm`): `fire` enqueues it
    on the calling thread's current stream, right behind the forward it follows."""

    room: int
    link: Link
    launch: Callable[[], PendingDigests]
    nbytes: int
    notice: Notice
    device: torch.device
    observer: WriteObserver = NOOP

    def fire(self) -> StartedWrite:
        return self.observer.firing(self._fire)

    def _fire(self) -> StartedWrite:
        stream, (began, ended) = _timed(self.device, 2)
        began.record(stream)
        pending = self.launch()
        if not pending.rung:
            pending.stage_to_host()  # the digests reach pinned host memory behind the write
        ended.record(stream)
        if pending.rung:
            self.notice.rung()
        return StartedWrite(self.room, self.link, pending, began, ended, self.nbytes, self.notice)


class MappedWriter:
    def __init__(
        self,
        rank: int,
        kv: KVPool,
        transport: Transport,
        *,
        bells: bool = True,
        observer: WriteObserver = NOOP,
    ) -> None:
        self.rank, self.kv, self.transport = rank, kv, transport
        self.pools = MappedPools(transport)  # decode pools this transport maps here
        self.ringers = Ringers(enabled=bells)  # decode doorbell boxes opened here
        self.observer = observer

    def warm(self) -> None:
        """Compile the write's kernels now, before any request pays for it (Triton's
        compile, on a host with an empty cache, docs/benchmarks.md): the
        pages of this pool's scratch page written onto themselves, digested, and a
        doorbell box of this process rung from the device. Equal TP's slice (every
        head) is the one warmed; a failure is logged, and the first write compiles."""
        kv, first = self.kv, self.kv.k_buffers[0]
        if first.device.type != "cuda":
            return
        try:
            with BellBox(1, 2 * len(kv.k_buffers)) as box, BellRinger(box.info) as ringer:
                ticket = box.ticket()
                assert ticket is not None
                k, v, scratch = kv.k_buffers, kv.v_buffers, [kv.scratch_row // kv.page_size]
                own = [b for pair in zip(k, v, strict=True) for b in pair]
                address = ringer.device_slot(ticket.slot, first.device)
                bell = None if address is None else (address, ticket.seq)
                every_head = KVSlice(0, first.shape[1], kv.page_size)
                target = PeerPages(own, scratch, 0)
                pending = start_slice_write(k, v, scratch, target, [(0, 1)], every_head, bell=bell)
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

    def arm(self, write: RoomWrite) -> ArmedWrite | None:
        """The write's host work, up to its launch (None: decode's pool is not mapped
        here, or its rows differ from ours; the caller writes by descriptors)."""
        return self.observer.arming(lambda: self._arm(write))

    def _arm(self, write: RoomWrite) -> ArmedWrite | None:
        reg, layout, pages, page_size = write.reg, write.layout, write.pages, self.kv.page_size
        first = self.kv.k_buffers[0]
        if reg.head_dim != first.shape[2] or reg.elem_bytes != first.element_size():
            return None
        bases = [address for pair in reg.kv_bases for address in pair]
        buffers = self.pools.buffers(write.peer, bases, reg.kv_heads, reg.head_dim, first)
        if buffers is None:
            return None
        plan = plan_segments(len(pages), page_size, layout.bytes_per_token(), reg.segment_bytes)
        nbytes = layout.block_bytes(write.writer, len(pages) * page_size)
        piece = layout.slices[write.writer]
        kv_slice = piece.source(page_size)
        notice = notice_for(self.ringers, write, self.rank, first.device)
        segments = [(segment.page_start, segment.num_pages) for segment in plan]
        target = PeerPages(buffers, reg.pages, piece.dst_head_start)
        k, v, bell = self.kv.k_buffers, self.kv.v_buffers, notice.device_bell
        launch = arm_slice_write(k, v, pages, target, segments, kv_slice, bell=bell)
        link = Link(self.transport, write.peer)
        return ArmedWrite(write.room, link, launch, nbytes, notice, first.device, self.observer)

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
        inline only names the caller to the observer."""
        device = self.kv.k_buffers[0].device
        rang = started.rang
        if rang:
            told = started.ended  # the device rang behind the write
        else:  # recorded once decode was told from here
            stream, (told,) = _timed(device, 1)
        started.ended.synchronize()  # the bytes are in decode's pool
        began_s = time.perf_counter()
        if not rang:  # the device did not ring: decode is told from here
            digests = list(chain.from_iterable(started.pending.result()))
            started.notice.tell(started.link, digests, started.nbytes)
            told.record(stream)
            told.synchronize()
        finish_s = time.perf_counter() - began_s
        seconds = started.began.elapsed_time(told) / 1e3
        device_s = started.began.elapsed_time(started.ended) / 1e3
        how = "doorbell (device)" if rang else started.notice.how
        self.observer.finished(started, how, inline, device_s, finish_s, seconds)
        started.done_s = seconds
        return seconds


def _timed(device: torch.device, count: int) -> tuple[Any, list[Any]]:
    """The calling thread's current stream and `count` timing events (on CUDA, ones
    whose record keeps the GIL: `staging.held`)."""
    stream = dev.current_device_stream(device)
    events = []
    for _ in range(count):
        event = held.held_event(device)
        events.append(event if event is not None else dev.create_device_event(device, timing=True))
    return stream, events
