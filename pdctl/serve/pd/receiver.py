"""Decode side, per TP rank: receive a room's KV into its pages.

The room's event was recorded on the scheduler stream right after its pages and
req_to_token row were written (the caller does that, then calls `receive`).
Staging: offer ring regions for the first segments (only regions the watermark
has freed), register with prefill's bootstrap, then per segment wait for every
writer's notification, land it (the handler checks the ring's digests, scatters
after the room's event, checks the pages and frees the region) and offer the
next. Direct: register the pages, wait, check the pages hold what was sent. Each
outcome is reported with what went wrong and where. A room given up before every
writer notified keeps the ring regions it did not land, fenced (`fence.py`) until
prefill confirms its senders of the room stopped.

The staging handlers own the ring and its lock: this module
speaks the protocol (offers become `SegmentRegion`s, notifications digests) and
never steps a handler through its internals.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.faults import RoomFaults
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.bells import Bells
from pdctl.serve.pd.client import Client, PeerCallError
from pdctl.serve.pd.fence import Fence
from pdctl.serve.pd.reports import RankReport, Report
from pdctl.staging.allocator import Region
from pdctl.staging.buffer import StagingRing, init_staging_allocator
from pdctl.staging.descriptors import tensor_ptr
from pdctl.staging.handler import DecodeStagingHandler, DigestMismatch, LandFaults, Offer
from pdctl.staging.layout import Segment, StagingLayout, head_slices, plan_segments
from pdctl.staging.transport import Transport, TransportError

log = logging.getLogger("pdctl.serve")
BELL_SLICE_S = 0.005  # a doorbell wait's slice: messages (a writer that cannot ring) between
MAX_ABORTED = 4096  # aborted rooms remembered (an abort may come before or after the receive)


class ReceiveFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Received:
    """What one rank's receive of a room did; notice: how its writers told it."""

    nbytes: int
    segments: int  # staged segments (0: direct)
    staging: bool
    notice: str  # "message" | "bell" (every writer rang its doorbell)

    def report(self, rank: int, transfer_ms: float) -> RankReport:
        """Rank `rank`'s report of the room, which took `transfer_ms` in all."""
        return RankReport(
            rank,
            True,
            bytes=self.nbytes,
            segments=self.segments,
            staging=self.staging,
            notice=self.notice,
            transfer_ms=transfer_ms,
        )


def segment_region(offer: Offer) -> proto.SegmentRegion:
    """A handler's offer as the protocol carries it to prefill."""
    segment, region, watermark = offer.segment, offer.region, offer.watermark
    return proto.SegmentRegion(
        segment.index,
        segment.page_start,
        segment.num_pages,
        offer.address,
        region.start,
        region.size,
        region.capacity,
        (watermark.round, watermark.tail),
    )


class KVReceiver:
    def __init__(
        self,
        *,
        rank: int,
        tp: int,
        name: str,
        kv: KVPool,
        transport: Transport,
        report: Report,
        staging: bool,
        pool_bytes: int,
        segment_bytes: int,
        bootstrap_timeout: float,
        transfer_timeout: float,
        bells: bool = True,
    ) -> None:
        self.rank, self.tp, self.name, self.kv = rank, tp, name, kv
        self.transport, self.report, self.staging = transport, report, staging
        self.segment_bytes = min(segment_bytes, pool_bytes)
        k = kv.k_buffers[0]
        page_bytes = (
            2 * len(kv.k_buffers) * kv.page_size * k.shape[1] * k.shape[2] * k.element_size()
        )
        if staging and self.segment_bytes < page_bytes:
            raise ValueError(
                f"a staging segment ({self.segment_bytes} bytes: the smaller of "
                f"--staging-segment-mb and --staging-pool-mb) cannot hold one page of this "
                f"rank's KV ({page_bytes} bytes); raise both to at least "
                f"{page_bytes / (1 << 20):g} MiB"
            )
        self.bootstrap_timeout, self.transfer_timeout = bootstrap_timeout, transfer_timeout
        device = kv.kv.device
        self.ring: StagingRing = init_staging_allocator(
            pool_bytes, device_type=device.type, gpu_id=device.index, overcommit_rounds=0
        )
        transport.register_tensor(self.ring.buffer.tensor)
        transport.set_kv_buffer_tensors(kv.k_buffers, kv.v_buffers, kv.page_size)
        # Rooms are received on several threads. The handlers (one per prefill TP) share
        # the ring, so they share the lock that guards it.
        self.ring_lock = threading.RLock()
        self.handlers: dict[int, DecodeStagingHandler] = {}  # prefill TP -> handler
        self.handlers_lock = threading.Lock()  # guards the dicts (handlers, aborted), no work
        self.infos: dict[str, proto.PrefillInfo] = {}
        self.clients: dict[str, Client] = {}
        self.executor = ThreadPoolExecutor(4, thread_name_prefix=f"pdctl-recv-{rank}")
        self.heads_total = kv.k_buffers[0].shape[1]
        self.aborted: OrderedDict[int, str] = OrderedDict()  # room -> why (the latest rooms)
        # longer than any send of prefill can last (each of its waits is bounded by these)
        bound_s = 2 * (bootstrap_timeout + transfer_timeout) + 10.0
        self.fence = Fence(name, self.client, bound_s)
        # None: notifications only
        self.bells = Bells.for_receiver(transport, kv, name, enabled=bells)

    # -- helpers ---------------------------------------------------------------------
    def client(self, address: str) -> Client:
        if address not in self.clients:
            self.clients[address] = Client(
                f"http://{address}", f"prefill bootstrap {address}", 10.0
            )
        return self.clients[address]

    def prefill_info(self, address: str, deadline: float) -> proto.PrefillInfo:
        if address not in self.infos:
            body = self.client(address).call("GET", "/bootstrap/info", retry_until=deadline)
            info = proto.PrefillInfo.from_json(body)
            self.fence.liveness.watch(address, info.process)
            self.infos[address] = info
        return self.infos[address]

    def handler(self, prefill_tp: int, num_kv_heads: int) -> DecodeStagingHandler:
        with self.handlers_lock:
            if prefill_tp not in self.handlers:
                layout = StagingLayout(
                    len(self.kv.k_buffers),
                    self.kv.k_buffers[0].shape[2],
                    self.kv.kv.element_size(),
                    head_slices(num_kv_heads, prefill_tp, self.tp, self.rank),
                )
                self.handlers[prefill_tp] = DecodeStagingHandler(
                    self.kv.k_buffers,
                    self.kv.v_buffers,
                    page_size=self.kv.page_size,
                    ring=self.ring,
                    layout=layout,
                    lock=self.ring_lock,
                )
            return self.handlers[prefill_tp]

    # -- one room --------------------------------------------------------------------
    def receive(
        self, room: int, pages: list[int], num_tokens: int, bootstrap: str, ready: Any
    ) -> None:
        self.executor.submit(self._run, room, pages, num_tokens, bootstrap, ready)

    def _run(
        self, room: int, pages: list[int], num_tokens: int, bootstrap: str, ready: Any
    ) -> None:
        started = time.monotonic()
        try:
            self._raise_if_aborted(room)  # given up while queued: nothing to register
            stats = self._receive(room, pages, num_tokens, bootstrap, ready)
            transfer_ms = round((time.monotonic() - started) * 1e3, 3)
            self.report(room, stats.report(self.rank, transfer_ms))
        except (ReceiveFailed, TransportError, PeerCallError) as exc:
            log.warning("room %s: %s", room, exc)
            self._failed(room, bootstrap, str(exc))
        except Exception as exc:
            log.exception("room %s: receive failed", room)
            self._failed(room, bootstrap, f"{self.name}: {exc}")

    def _failed(self, room: int, bootstrap: str, error: str) -> None:
        """Tell prefill to stop sending the room (best effort), fence the regions it may
        still write, then report."""
        try:
            body = {"room": room, "reason": f"decode: {error}"}
            self.client(bootstrap).call("POST", "/bootstrap/fail", json=body, timeout=3.0)
        except PeerCallError as exc:
            log.info("room %s: could not tell prefill: %s", room, exc)
        with self.handlers_lock:
            holding = [h for h in self.handlers.values() if room in h.fenced]
        for handler in holding:
            self.fence.add(
                room, bootstrap, f"decode: {error}", partial(handler.release_fenced, room)
            )
        self.report(room, RankReport(self.rank, False, error))

    def _receive(
        self, room: int, pages: list[int], num_tokens: int, bootstrap: str, ready: Any
    ) -> Received:
        deadline = time.monotonic() + self.bootstrap_timeout
        info = self.prefill_info(bootstrap, deadline)
        prefill_tp, heads = info.tp, info.num_kv_heads
        staged = self.staging and prefill_tp != self.tp
        base = proto.Registration(
            room=room,
            decode_rank=self.rank,
            decode_tp=self.tp,
            decode_name=self.name,
            transport=base64.b64encode(self.transport.describe()).decode(),
            num_tokens=num_tokens,
            page_size=self.kv.page_size,
            mode="staging" if staged else "direct",
            kv_heads=self.heads_total,
            head_dim=self.kv.k_buffers[0].shape[2],
            num_layers=len(self.kv.k_buffers),
            elem_bytes=self.kv.kv.element_size(),
            segment_bytes=self.segment_bytes,
        )
        handler = self.handler(prefill_tp, heads)
        if staged:
            return self._staged(room, pages, base, handler, bootstrap, ready)
        return self._direct(room, pages, base, handler, bootstrap)

    def _register(self, bootstrap: str, registration: proto.Registration) -> None:
        deadline = time.monotonic() + self.bootstrap_timeout
        self.client(bootstrap).call(
            "POST", "/bootstrap/register", json=registration.to_json(), retry_until=deadline
        )

    def _offer_more(
        self, handler: DecodeStagingHandler, room: int, plan: tuple[Segment, ...], bootstrap: str
    ) -> None:
        """Offer prefill regions for the next segments, as far as the ring has space."""
        more = [segment_region(offer) for offer in handler.offer(room, plan)]
        if more:
            body = {"room": room, "decode_rank": self.rank, "segments": [asdict(s) for s in more]}
            self.client(bootstrap).call("POST", "/bootstrap/segments", json=body)

    def _region_for(
        self,
        handler: DecodeStagingHandler,
        room: int,
        plan: tuple[Segment, ...],
        segment: Segment,
        bootstrap: str,
    ) -> Region:
        """Wait until the ring frees a region for `segment` (other rooms' data drains)."""
        deadline = time.monotonic() + self.transfer_timeout
        while (region := handler.region_of(room, segment)) is None:
            self._raise_if_aborted(room)
            if time.monotonic() >= deadline:
                raise ReceiveFailed(
                    f"{self.name}: no staging ring region freed for segment {segment.index} of "
                    f"room {room} within {self.transfer_timeout:g} s (the ring is full of other "
                    "rooms' data; a larger --staging-pool-mb helps)"
                )
            self._offer_more(handler, room, plan, bootstrap)
            if handler.region_of(room, segment) is None:
                time.sleep(0.002)
        return region

    def _staged(
        self,
        room: int,
        pages: list[int],
        registration: proto.Registration,
        handler: DecodeStagingHandler,
        bootstrap: str,
        ready: Any,
    ) -> Received:
        drop = RoomFaults.for_decode().drop_first_scatter  # fault injection, drawn once
        handler.open_room(room, pages, ready=ready, faults=LandFaults(skip_first_scatter=drop))
        landed = False  # every segment: no writer has anything left to write here
        try:
            plan = plan_segments(
                len(pages), self.kv.page_size, handler.layout.bytes_per_token(), self.segment_bytes
            )
            # Register at once, even with the ring full: prefill serves each decode rank
            # as it registers, and regions are offered as they free.
            registration.segments = [segment_region(o) for o in handler.offer(room, plan)]
            self._register(bootstrap, registration)
            total = 0
            for segment in plan:
                region = self._region_for(handler, room, plan, segment, bootstrap)
                wait = (
                    self.bootstrap_timeout + self.transfer_timeout
                    if segment.index == 0
                    else self.transfer_timeout
                )
                expected, _ = self._await(room, segment.index, handler.layout, wait, bootstrap)
                mismatch = handler.land(room, segment, expected)
                if mismatch is not None:
                    where = (
                        f"in the staging ring, segment {segment.index}"
                        if mismatch.place == "ring"
                        else f"after the scatter of segment {segment.index}"
                    )
                    raise self._corruption(room, mismatch, where)
                total += region.size
                self._offer_more(handler, room, plan, bootstrap)
            landed = True
            return Received(total, len(plan), staging=True, notice="message")
        finally:
            handler.close_room(room, fence=not landed)  # `_failed` hands them to the fence

    def _corruption(self, room: int, mismatch: DigestMismatch, where: str) -> ReceiveFailed:
        return ReceiveFailed(
            f"KV corruption in room {room}: layer {mismatch.layer} {mismatch.kv} from prefill "
            f"rank {mismatch.prefill_rank} to decode rank {self.rank} ({where})"
        )

    def _await(
        self,
        room: int,
        segment: int,
        layout: StagingLayout,
        wait: float,
        bootstrap: str,
        bell: tuple[proto.BellOffer, tuple[Segment, ...]] | None = None,
    ) -> tuple[list[list[int]], set[int]]:
        """Digests from every writer of `segment`, in writer order, and the writers that
        told by their doorbell. `bell`: the room's offer and its plan (the digest
        segments a ring's sums are finalised by).

        Every second without news the room is looked up on prefill's bootstrap, so a
        prefill that died or failed the room ends the wait at once, with its reason.
        A writer with a ticket is also heard by message (one that could not open the
        box): its doorbell is waited on in slices of BELL_SLICE_S, messages between.
        """
        digests: list[list[int]] = []
        rang: set[int] = set()
        deadline = time.monotonic() + wait
        check_at = time.monotonic() + 1.0
        for writer, piece in enumerate(layout.slices):
            prefix = proto.notify_prefix(room, segment, piece.prefill_rank)
            ticket = None if bell is None or self.bells is None else bell[0].tickets[writer]
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReceiveFailed(
                        f"{self.name}: prefill rank {piece.prefill_rank} ({bootstrap}) sent "
                        f"nothing for segment {segment} of room {room} within {wait:g} s"
                    )
                self._raise_if_aborted(room)
                if time.monotonic() >= check_at:
                    self._check_prefill(room, bootstrap)
                    check_at = time.monotonic() + 1.0
                if ticket is not None and self.bells is not None and bell is not None:
                    rung = self.bells.box.wait(ticket, min(remaining, BELL_SLICE_S))
                    if rung is not None:
                        digests.append(self.bells.digests(*rung, piece, bell[1]))
                        rang.add(writer)
                        break
                    note = self.transport.take_notification(prefix, prefix=True)
                else:
                    try:
                        note = self.transport.wait_notification(
                            prefix, min(remaining, 0.25), prefix=True
                        )
                    except TransportError:
                        continue
                if note is not None:
                    digests.append(proto.parse_notify(note.message).digests)
                    break
        return digests, rang

    def _check_prefill(self, room: int, bootstrap: str) -> None:
        try:
            state = self.client(bootstrap).call("GET", f"/bootstrap/room/{room}", timeout=3.0)
        except PeerCallError as exc:
            raise ReceiveFailed(
                f"{self.name}: waiting for room {room}: {exc} (did the prefill server die?)"
            ) from None
        closed = state.get("closed")
        if closed and closed != "finished":
            raise ReceiveFailed(f"{self.name}: prefill {bootstrap} closed room {room}: {closed}")

    def abort(self, room: int, reason: str = "its request was aborted") -> None:
        """Stop waiting for `room`; its regions are released. The first reason stays."""
        with self.handlers_lock:
            self.aborted.setdefault(room, reason)
            while len(self.aborted) > MAX_ABORTED:
                self.aborted.popitem(last=False)

    def _raise_if_aborted(self, room: int) -> None:
        reason = self.aborted.get(room)
        if reason is not None:
            raise ReceiveFailed(f"{self.name}: room {room} was aborted ({reason})")

    def _direct(
        self,
        room: int,
        pages: list[int],
        registration: proto.Registration,
        handler: DecodeStagingHandler,
        bootstrap: str,
    ) -> Received:
        registration.pages = list(pages)
        registration.kv_bases = [
            [tensor_ptr(k), tensor_ptr(v)]
            for k, v in zip(self.kv.k_buffers, self.kv.v_buffers, strict=True)
        ]
        layout = handler.layout
        plan = plan_segments(
            len(pages), self.kv.page_size, layout.bytes_per_token(), self.segment_bytes
        )
        offer = self.bells.offer(layout, len(plan)) if self.bells is not None else None
        registration.bell = offer
        rang: set[int] = set()  # writers whose ring was read: their tickets go back
        try:
            self._register(bootstrap, registration)
            wait = self.bootstrap_timeout + self.transfer_timeout
            bell = None if offer is None else (offer, plan)
            expected, rang = self._await(room, proto.DIRECT_SEGMENT, layout, wait, bootstrap, bell)
        finally:
            if offer is not None and self.bells is not None:
                self.bells.give_back(offer, rang)
        mismatch = handler.check_pages(pages, plan, expected)
        if mismatch is not None:
            raise self._corruption(room, mismatch, "direct write")
        nbytes = len(pages) * self.kv.page_size * layout.bytes_per_token()
        notice = "bell" if len(rang) == len(layout.slices) else "message"
        return Received(nbytes, 0, staging=False, notice=notice)
