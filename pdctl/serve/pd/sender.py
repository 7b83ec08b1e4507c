"""Prefill side, per TP rank: send a room's KV to every decode rank that needs it.

Each room is sent on its own worker thread, so a room waiting for decode to offer
a ring region never holds up another room whose region is already there (decode
may hold regions for rooms in another order than prefill finishes them). Staging
buffers come from a small pool, held only from a gather until its write is done.

For each decode rank this prefill rank writes to (its head slice, `writers_of`):
staging: for every segment, wait until decode offers a ring region (its watermark
must show the region free), gather the head slice of the segment's pages into the
staging buffer, write it at this writer's block offset, notify with the digests.
direct (equal TP, or staging disabled): write the pages (or, with TP differing,
each token's head slice) straight into decode's KV pages and tell decode
(`direct`: by its doorbell where it offered one on this host, else a notification).
Where the transport maps decode's pool here, one launch writes and digests the pages
(`mapped_write`). When decode registered in time, that launch is armed before the
forward computing the prompt's last piece is enqueued (`arm`) and fired right behind
it on the thread that enqueued it (`early`); otherwise the room's worker starts or
finishes it.
Failures are reported with the decode rank they concern. A room's faults
(`RoomFaults`) are drawn once and travel with its clock as one `early.RoomJob`; addresses
and descriptors are computed by `staging.descriptors`.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.faults import RoomFaults
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.client import PeerCallError
from pdctl.serve.pd.corrupt_kv import PLAIN, CorruptKV, RoomWrites
from pdctl.serve.pd.direct import DirectWriter
from pdctl.serve.pd.early import EarlyWrites, RoomJob, SendClock, Snapshot, settle
from pdctl.serve.pd.mapped_write import NOOP, MappedWriter, RoomWrite, WriteObserver
from pdctl.serve.pd.room_state import RoomWait
from pdctl.staging import device as dev
from pdctl.staging.buffer import init_staging_buffers
from pdctl.staging.descriptors import block_address
from pdctl.staging.digest import block_digests
from pdctl.staging.kernels import gather_all_layers_to_staging
from pdctl.staging.layout import HeadSlice, StagingLayout, head_slices, plan_segments
from pdctl.staging.transport import Peer, Transport, TransportError

log = logging.getLogger("pdctl.serve")
Report = Callable[[int, dict[str, Any]], None]


class SendFailed(RuntimeError):
    pass


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
        self.rank, self.tp, self.heads, self.kv = rank, tp, num_kv_heads, kv
        self.transport, self.snapshot, self.report = transport, snapshot, report
        self.bootstrap_timeout, self.transfer_timeout = bootstrap_timeout, transfer_timeout
        self.segment_bytes = segment_bytes
        device = kv.kv.device
        self.buffers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for buffer in init_staging_buffers(
            segment_bytes, buffers, device_type=device.type, gpu_id=device.index
        ):
            transport.register_tensor(buffer.tensor)
            self.buffers.put(buffer)
        transport.register_tensor(kv.kv)  # direct page writes read the pool itself
        self.mapped = MappedWriter(rank, kv, transport, bells=bells, observer=observer)
        if transport.RINGS_BELLS:  # same-host device writes are mapped writes: compile them now
            self.mapped.warm()
        self.direct = DirectWriter(self.mapped, self._buffer)
        self.early = EarlyWrites(
            self.mapped, snapshot, self._targets, self._connected, self._draw_faults, notify_at
        )
        self.peers: dict[str, Peer] = {}
        self.peers_lock = threading.Lock()
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

    def _connected(self, transport: str) -> Peer | None:
        """The peer of a decode transport connected before (None: not yet)."""
        with self.peers_lock:
            return self.peers.get(transport)

    def _draw_faults(self, room: int) -> RoomFaults:
        return RoomFaults.for_prefill(self.bootstrap_timeout + self.transfer_timeout + 2, room=room)

    @staticmethod
    def _writes(job: RoomJob) -> RoomWrites:
        """The room's writes as its faults have them (corrupt-kv: a byte flipped)."""
        return CorruptKV() if job.faults.corrupt_kv else PLAIN

    def _land_late(self, room: int, job: RoomJob) -> None:
        """abort-transfer (fault injection): this write was in flight when decode gave
        the room up; it lands `late_write_s` after the room closed (waited for, bounded)."""
        if job.faults.late_write_s is not None:
            self.snapshot(room, self.transfer_timeout, RoomWait.closed())
            time.sleep(job.faults.late_write_s)

    def _targets(self, decode_tp: int) -> Iterator[tuple[int, StagingLayout, int]]:
        """(decode rank, its layout, this rank's writer index) for each decode rank this
        prefill rank writes heads to."""
        head_dim, elem_bytes = self.kv.k_buffers[0].shape[2], self.kv.k_buffers[0].element_size()
        for decode_rank in range(decode_tp):
            slices = head_slices(self.heads, self.tp, decode_tp, decode_rank)
            mine = [i for i, s in enumerate(slices) if s.prefill_rank == self.rank]
            if mine:
                yield (
                    decode_rank,
                    StagingLayout(len(self.kv.k_buffers), head_dim, elem_bytes, slices),
                    mine[0],
                )

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
            stats["transfer_ms"] = round((time.monotonic() - started) * 1e3, 3)
            self.report(room, {"rank": self.rank, "ok": True, **stats})
        except (SendFailed, TransportError, PeerCallError) as exc:
            log.warning("room %s: %s", room, exc)
            settle(room, job)  # reported ended: nothing of it may still be landing
            self.report(room, {"rank": self.rank, "ok": False, "error": str(exc)})
        except Exception as exc:  # a bug must still fail the room, not hang it
            log.exception("room %s: send failed", room)
            settle(room, job)
            self.report(
                room, {"rank": self.rank, "ok": False, "error": f"prefill rank {self.rank}: {exc}"}
            )

    def _registration(
        self, room: int, decode_rank: int | None, deadline: float
    ) -> proto.Registration:
        """Decode rank `decode_rank`'s registration of `room` (None: whichever comes first).

        Each decode rank is served as soon as it registered: waiting for all of them
        first could deadlock with a rank whose ring is full of this prefill's other rooms.
        """
        condition = RoomWait.registered(decode_rank)
        while True:
            wait = max(0.0, min(5.0, deadline - time.monotonic()))
            state = self.snapshot(room, wait, condition)
            if state.get("closed"):
                raise SendFailed(f"room {room} closed before sending: {state['closed']}")
            registrations = state["registrations"]
            key = next(iter(registrations), None) if decode_rank is None else str(decode_rank)
            if key in registrations:
                return proto.Registration.from_json(registrations[key])
            if time.monotonic() >= deadline:
                who = (
                    "no decode rank" if decode_rank is None else f"decode rank {decode_rank} never"
                )
                raise SendFailed(
                    f"{who} registered room {room} within {self.bootstrap_timeout:g} s"
                )

    def _peer(self, registration: proto.Registration) -> Peer:
        with self.peers_lock:
            if registration.transport not in self.peers:
                self.peers[registration.transport] = self.transport.connect(
                    base64.b64decode(registration.transport)
                )
            return self.peers[registration.transport]

    @contextmanager
    def _buffer(self) -> Iterator[Any]:
        """A staging buffer from the pool, for one gather and the write that reads it."""
        buffer = self.buffers.get()
        try:
            yield buffer
        finally:
            self.buffers.put(buffer)

    def _send(self, room: int, pages: list[int], job: RoomJob | None) -> dict[str, Any]:
        deadline = time.monotonic() + self.bootstrap_timeout
        decode_tp = self._registration(room, None, deadline).decode_tp
        if job is None:
            job = RoomJob(self._draw_faults(room))
        if job.faults.delay_s is not None:  # decode is waiting now; hold the room past it
            time.sleep(job.faults.delay_s)
        total, segments, busy = 0, 0, 0.0
        for decode_rank, layout, writer in self._targets(decode_tp):
            early = job.early.get(decode_rank)
            if early is not None:  # enqueued behind the forward: wait, notify (if not yet)
                busy += early.done_s if early.done_s is not None else self.mapped.finish(early)
                total += early.nbytes
                continue
            registration = self._registration(room, decode_rank, deadline)
            layout = StagingLayout(  # decode's row shape, as it registered
                len(self.kv.k_buffers),
                registration.head_dim,
                registration.elem_bytes,
                layout.slices,
            )
            started = time.perf_counter()
            if registration.mode == "staging":
                sent, count, waited = self._staged(room, pages, registration, layout, writer, job)
            else:
                sent, count, waited = self._direct(room, pages, registration, layout, writer, job)
            busy += time.perf_counter() - started - waited
            total, segments = total + sent, segments + count
        # write_ms: gathering, digests and writes only (not waiting for decode's regions)
        return {
            "bytes": total,
            "segments": segments,
            "write_ms": round(busy * 1e3, 3),
            "gather_ms": round(job.clock.gather * 1e3, 3),
            "digest_ms": round(job.clock.digest * 1e3, 3),
        }

    def _plan(self, pages: list[int], layout: StagingLayout, reg: proto.Registration) -> Any:
        """Decode's segments (its segment size), each checked to fit a staging buffer here."""
        plan = plan_segments(
            len(pages), self.kv.page_size, layout.bytes_per_token(), reg.segment_bytes
        )
        writers = range(len(layout.slices))
        needed = max(
            layout.block_bytes(w, s.num_tokens(self.kv.page_size)) for s in plan for w in writers
        )
        if needed > self.segment_bytes:
            raise SendFailed(
                f"decode rank {reg.decode_rank} cuts rooms into segments of "
                f"{reg.segment_bytes / (1 << 20):g} MiB, which needs a {needed / (1 << 20):g} MiB "
                f"staging buffer on prefill (it has {self.segment_bytes / (1 << 20):g} MiB); "
                "give both roles the same --staging-segment-mb"
            )
        return plan

    def _gather(
        self, buffer: Any, pages: list[int], piece: HeadSlice, clock: SendClock
    ) -> tuple[int, list[int]]:
        started = time.perf_counter()
        nbytes = gather_all_layers_to_staging(
            self.kv.k_buffers,
            self.kv.v_buffers,
            pages,
            buffer.tensor,
            src_head_start=piece.src_head_start,
            num_heads=piece.num_heads,
            page_size=self.kv.page_size,
        )
        dev.synchronize_stream(buffer.producer_stream())  # the transport reads next
        gathered = time.perf_counter()
        digests = block_digests(buffer.view(0, nbytes), len(self.kv.k_buffers))
        clock.gather += gathered - started
        clock.digest += time.perf_counter() - gathered
        return nbytes, digests

    def _staged(
        self,
        room: int,
        pages: list[int],
        reg: proto.Registration,
        layout: StagingLayout,
        writer: int,
        job: RoomJob,
    ) -> tuple[int, int, float]:
        piece = layout.slices[writer]
        peer = self._peer(reg)
        sent, waited = 0, 0.0
        plan = self._plan(pages, layout, reg)
        for segment in plan:
            started = time.perf_counter()
            region = self._region(room, reg.decode_rank, segment.index)
            waited += time.perf_counter() - started
            if not region.writable():
                raise SendFailed(
                    f"decode rank {reg.decode_rank} offered a region its watermark has not freed"
                )
            chunk = pages[segment.page_start : segment.page_start + segment.num_pages]
            destination = block_address(
                region.address, layout, writer, segment.num_tokens(self.kv.page_size)
            )
            with self._buffer() as buffer:
                nbytes, digests = self._gather(buffer, chunk, piece, job.clock)
                self._writes(job).gathered(buffer, nbytes, segment.index)
                message = proto.notify_message(room, segment.index, self.rank, digests, nbytes)
                self._land_late(room, job)
                self.transport.write(peer, [buffer.ptr], [destination], [nbytes], notify=message)
            sent += nbytes
        return sent, len(plan), waited

    def _region(self, room: int, decode_rank: int, index: int) -> proto.SegmentRegion:
        deadline = time.monotonic() + self.transfer_timeout
        condition = RoomWait.offered(decode_rank, index)
        while True:
            wait = max(0.0, min(5.0, deadline - time.monotonic()))
            state = self.snapshot(room, wait, condition)
            if state.get("closed"):
                raise SendFailed(f"room {room} closed while sending: {state['closed']}")
            registration = proto.Registration.from_json(state["registrations"][str(decode_rank)])
            for region in registration.segments:
                if region.index == index:
                    return region
            if time.monotonic() >= deadline:
                raise SendFailed(
                    f"decode rank {decode_rank} offered no ring region for segment {index} of room "
                    f"{room} within {self.transfer_timeout:g} s"
                )

    def _direct(
        self,
        room: int,
        pages: list[int],
        reg: proto.Registration,
        layout: StagingLayout,
        writer: int,
        job: RoomJob,
    ) -> tuple[int, int, float]:
        plan = plan_segments(
            len(pages), self.kv.page_size, layout.bytes_per_token(), reg.segment_bytes
        )
        write = RoomWrite(room, pages, reg, layout, writer, self._peer(reg))
        self._land_late(room, job)
        sent = self._writes(job).direct(self.direct, write, plan, job.clock)
        return sent, 0, 0.0
