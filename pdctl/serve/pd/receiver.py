"""Decode side, per TP rank: receive a room's KV into its pages.

The room's event was recorded on the scheduler stream right after its pages and
req_to_token row were written (the caller does that, then calls `receive`).
Staging: offer ring regions for the first segments (only regions the watermark
has freed), register with prefill's bootstrap, then per segment wait for every
writer's notification, check the digests, scatter (after the room's event), free
the region and offer the next. Direct: register the pages, wait, verify the
digests of what landed. Each outcome is reported with what went wrong and where.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from pdctl.serve.faults import faults
from pdctl.serve.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.client import Client, PeerCallError
from pdctl.staging import device as dev
from pdctl.staging.allocator import Region
from pdctl.staging.buffer import StagingRing, init_staging_allocator, init_staging_buffers
from pdctl.staging.descriptors import tensor_ptr
from pdctl.staging.digest import block_digests
from pdctl.staging.handler import DecodeStagingHandler
from pdctl.staging.kernels import gather_all_layers_to_staging
from pdctl.staging.layout import Segment, StagingLayout, head_slices, plan_segments
from pdctl.staging.transport import Transport, TransportError

log = logging.getLogger("pdctl.serve")
Report = Callable[[int, dict[str, Any]], None]


class ReceiveFailed(RuntimeError):
    pass


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
        (self.check_buffer,) = init_staging_buffers(
            self.segment_bytes, device_type=device.type, gpu_id=device.index
        )
        self.handlers: dict[int, DecodeStagingHandler] = {}  # prefill TP -> handler
        self.infos: dict[str, dict[str, Any]] = {}
        self.clients: dict[str, Client] = {}
        self.executor = ThreadPoolExecutor(4, thread_name_prefix=f"pdctl-recv-{rank}")
        self.heads_total = kv.k_buffers[0].shape[1]
        self.aborted: set[int] = set()
        # Rooms are received on several threads; the ring, its handlers and the check
        # buffer are shared, so every step that touches them holds this lock.
        self.lock = threading.Lock()

    # -- helpers ---------------------------------------------------------------------
    def client(self, address: str) -> Client:
        if address not in self.clients:
            self.clients[address] = Client(
                f"http://{address}", f"prefill bootstrap {address}", 10.0
            )
        return self.clients[address]

    def prefill_info(self, address: str, deadline: float) -> dict[str, Any]:
        if address not in self.infos:
            self.infos[address] = self.client(address).call(
                "GET", "/bootstrap/info", retry_until=deadline
            )
        return self.infos[address]

    def handler(self, prefill_tp: int, num_kv_heads: int) -> DecodeStagingHandler:
        if prefill_tp not in self.handlers:
            layout = StagingLayout(
                len(self.kv.k_buffers), self.kv.k_buffers[0].shape[2], self.kv.kv.element_size(),
                head_slices(num_kv_heads, prefill_tp, self.tp, self.rank),
            )  # fmt: skip
            self.handlers[prefill_tp] = DecodeStagingHandler(
                self.kv.k_buffers,
                self.kv.v_buffers,
                page_size=self.kv.page_size,
                ring=self.ring,
                layout=layout,
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
            stats = self._receive(room, pages, num_tokens, bootstrap, ready)
            stats["transfer_ms"] = round((time.monotonic() - started) * 1e3, 3)
            self.report(room, {"rank": self.rank, "ok": True, **stats})
        except (ReceiveFailed, TransportError, PeerCallError) as exc:
            log.warning("room %s: %s", room, exc)
            self._failed(room, bootstrap, str(exc))
        except Exception as exc:
            log.exception("room %s: receive failed", room)
            self._failed(room, bootstrap, f"{self.name}: {exc}")

    def _failed(self, room: int, bootstrap: str, error: str) -> None:
        """Tell prefill to stop sending the room (best effort), then report."""
        try:
            body = {"room": room, "reason": f"decode: {error}"}
            self.client(bootstrap).call("POST", "/bootstrap/fail", json=body, timeout=3.0)
        except PeerCallError as exc:
            log.info("room %s: could not tell prefill: %s", room, exc)
        self.report(room, {"rank": self.rank, "ok": False, "error": error})

    def _receive(
        self, room: int, pages: list[int], num_tokens: int, bootstrap: str, ready: Any
    ) -> dict[str, Any]:
        deadline = time.monotonic() + self.bootstrap_timeout
        info = self.prefill_info(bootstrap, deadline)
        prefill_tp, heads = int(info["tp"]), int(info["num_kv_heads"])
        staged = self.staging and prefill_tp != self.tp
        base = proto.Registration(
            room=room, decode_rank=self.rank, decode_tp=self.tp, decode_name=self.name,
            transport=base64.b64encode(self.transport.describe()).decode(),
            num_tokens=num_tokens, page_size=self.kv.page_size,
            mode="staging" if staged else "direct", kv_heads=self.heads_total,
            head_dim=self.kv.k_buffers[0].shape[2],
            num_layers=len(self.kv.k_buffers), elem_bytes=self.kv.kv.element_size(),
            segment_bytes=self.segment_bytes,
        )  # fmt: skip
        with self.lock:
            handler = self.handler(prefill_tp, heads)
        if staged:
            return self._staged(room, pages, base, handler, bootstrap, ready)
        return self._direct(room, pages, base, handler, bootstrap)

    def _register(self, bootstrap: str, registration: proto.Registration) -> None:
        deadline = time.monotonic() + self.bootstrap_timeout
        self.client(bootstrap).call(
            "POST", "/bootstrap/register", json=registration.to_json(), retry_until=deadline
        )

    def _offer(
        self,
        handler: DecodeStagingHandler,
        room: int,
        plan: tuple[Segment, ...],
        offered: dict[int, Region],
    ) -> list[proto.SegmentRegion]:
        """Assign ring regions for the next segments while the ring has free space."""
        fresh = []
        for segment in plan:
            if segment.index in offered:
                continue
            region = handler.assign_region(room, segment)
            if region is None:
                break
            offered[segment.index] = region
            watermark = self.ring.allocator.watermark
            fresh.append(
                proto.SegmentRegion(
                    segment.index,
                    segment.page_start,
                    segment.num_pages,
                    self.ring.buffer.ptr + region.offset,
                    region.start,
                    region.size,
                    region.capacity,
                    (watermark.round, watermark.tail),
                )
            )
        return fresh

    def _offer_more(
        self,
        handler: DecodeStagingHandler,
        room: int,
        plan: tuple[Segment, ...],
        offered: dict[int, Region],
        bootstrap: str,
    ) -> None:
        """Offer prefill regions for the next segments, as far as the ring has space."""
        with self.lock:
            handler.reap(room)  # regions whose scatter finished are free again
            more = self._offer(handler, room, plan, offered)
        if more:
            body = {"room": room, "decode_rank": self.rank, "segments": [asdict(s) for s in more]}
            self.client(bootstrap).call("POST", "/bootstrap/segments", json=body)

    def _region_for(
        self,
        handler: DecodeStagingHandler,
        room: int,
        plan: tuple[Segment, ...],
        segment: Segment,
        offered: dict[int, Region],
        bootstrap: str,
    ) -> Region:
        """Wait until the ring frees a region for `segment` (other rooms' data drains)."""
        deadline = time.monotonic() + self.transfer_timeout
        while segment.index not in offered:
            if room in self.aborted:
                raise ReceiveFailed(f"{self.name}: room {room} was aborted")
            if time.monotonic() >= deadline:
                raise ReceiveFailed(
                    f"{self.name}: no staging ring region freed for segment {segment.index} of "
                    f"room {room} within {self.transfer_timeout:g} s (the ring is full of other "
                    "rooms' data; a larger --staging-pool-mb helps)"
                )
            self._offer_more(handler, room, plan, offered, bootstrap)
            if segment.index not in offered:
                time.sleep(0.002)
        return offered[segment.index]

    def _staged(
        self,
        room: int,
        pages: list[int],
        registration: proto.Registration,
        handler: DecodeStagingHandler,
        bootstrap: str,
        ready: Any,
    ) -> dict[str, Any]:
        with self.lock:
            handler.register_room(room, pages, ready=ready)
        try:
            layout = handler.layout
            plan = plan_segments(
                len(pages), self.kv.page_size, layout.bytes_per_token(), self.segment_bytes
            )
            offered: dict[int, Region] = {}
            drop = faults().hit("drop-scatter") is not None  # fault injection
            # Register at once, even with the ring full: prefill serves each decode rank
            # as it registers, and regions are offered as they free.
            with self.lock:
                registration.segments = self._offer(handler, room, plan, offered)
            self._register(bootstrap, registration)
            total = 0
            for segment in plan:
                region = self._region_for(handler, room, plan, segment, offered, bootstrap)
                wait = (
                    self.bootstrap_timeout + self.transfer_timeout
                    if segment.index == 0
                    else self.transfer_timeout
                )
                expected = self._await(room, segment.index, layout, wait, bootstrap)
                with self.lock:
                    mismatch = handler.check_digests(region, segment, expected)
                    if mismatch is None:
                        if not (drop and segment.index == 0):
                            handler.scatter(room, region, segment)
                        dev.synchronize_stream(handler.scatter_stream)
                        self._verify_pages(
                            room, pages, layout, (segment,), expected,
                            f"after the scatter of segment {segment.index}",
                        )  # fmt: skip
                        handler.reap(room)
                if mismatch is not None:
                    raise ReceiveFailed(
                        f"KV corruption in room {room}: layer {mismatch.layer} {mismatch.kv} "
                        f"from prefill rank {mismatch.prefill_rank} to decode rank {self.rank} "
                        f"(in the staging ring, segment {segment.index})"
                    )
                total += region.size
                self._offer_more(handler, room, plan, offered, bootstrap)
            return {"bytes": total, "segments": len(plan), "staging": True}
        finally:
            with self.lock:
                handler.release_room(room)

    def _await(
        self, room: int, segment: int, layout: StagingLayout, wait: float, bootstrap: str
    ) -> list[list[int]]:
        """Digests from every writer of `segment`, in writer order.

        Every second without news the room is looked up on prefill's bootstrap, so a
        prefill that died or failed the room ends the wait at once, with its reason.
        """
        digests = []
        deadline = time.monotonic() + wait
        check_at = time.monotonic() + 1.0
        for piece in layout.slices:
            prefix = proto.notify_prefix(room, segment, piece.prefill_rank)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReceiveFailed(
                        f"{self.name}: prefill rank {piece.prefill_rank} ({bootstrap}) sent "
                        f"nothing for segment {segment} of room {room} within {wait:g} s"
                    )
                if room in self.aborted:
                    raise ReceiveFailed(f"{self.name}: room {room} was aborted")
                if time.monotonic() >= check_at:
                    self._check_prefill(room, bootstrap)
                    check_at = time.monotonic() + 1.0
                try:
                    note = self.transport.wait_notification(
                        prefix, min(remaining, 0.25), prefix=True
                    )
                    break
                except TransportError:
                    continue
            digests.append(list(proto.parse_notify(note.message)["digests"]))
        return digests

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

    def abort(self, room: int) -> None:
        """Stop waiting for `room` (its request was aborted); its regions are released."""
        self.aborted.add(room)

    def _direct(
        self,
        room: int,
        pages: list[int],
        registration: proto.Registration,
        handler: DecodeStagingHandler,
        bootstrap: str,
    ) -> dict[str, Any]:
        registration.pages = list(pages)
        registration.kv_bases = [
            [tensor_ptr(k), tensor_ptr(v)]
            for k, v in zip(self.kv.k_buffers, self.kv.v_buffers, strict=True)
        ]
        self._register(bootstrap, registration)
        layout = handler.layout
        wait = self.bootstrap_timeout + self.transfer_timeout
        expected = self._await(room, proto.DIRECT_SEGMENT, layout, wait, bootstrap)
        plan = plan_segments(
            len(pages), self.kv.page_size, layout.bytes_per_token(), self.segment_bytes
        )
        with self.lock:
            self._verify_pages(room, pages, layout, plan, expected, "direct write")
        nbytes = len(pages) * self.kv.page_size * layout.bytes_per_token()
        return {"bytes": nbytes, "segments": 0, "staging": False}

    def _verify_pages(
        self,
        room: int,
        pages: list[int],
        layout: StagingLayout,
        plan: tuple[Segment, ...],
        expected: list[list[int]],
        where: str,
    ) -> None:
        """Gather what is in the room's pages for `plan`'s segments and compare it with
        the writers' digests: proof that the KV landed in the pages, not only the ring."""
        layers = len(self.kv.k_buffers)
        for writer, piece in enumerate(layout.slices):
            received = []
            for segment in plan:
                chunk = pages[segment.page_start : segment.page_start + segment.num_pages]
                nbytes = gather_all_layers_to_staging(
                    self.kv.k_buffers, self.kv.v_buffers, chunk, self.check_buffer.tensor,
                    src_head_start=piece.dst_head_start, num_heads=piece.num_heads,
                    page_size=self.kv.page_size,
                )  # fmt: skip
                received += block_digests(self.check_buffer.view(0, nbytes), layers)
            if received != expected[writer]:
                index = next(
                    i
                    for i, (a, b) in enumerate(zip(received, expected[writer], strict=False))
                    if a != b
                )
                raise ReceiveFailed(
                    f"KV corruption in room {room}: layer {(index // 2) % layers} "
                    f"{'KV'[index % 2]} from prefill rank {piece.prefill_rank} to decode rank "
                    f"{self.rank} ({where})"
                )
