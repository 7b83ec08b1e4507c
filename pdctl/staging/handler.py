"""Decode side of a staged transfer: rooms, ring regions, ordered scatters, checks, release.

Ordering, per room (a request's KV transfer):

    scheduler stream:  alloc pages, write req_to_token row, record E(room)
    scatter stream:    wait E(room)  ->  scatter region into pages  ->  record D
    host:              D complete    ->  check the pages, free region, advance the watermark

The scatter waits on the room's event, not on the scheduler stream: waiting on the
stream would also queue the scatter behind whatever forward runs there. Closing a
room drains the (shared) scatter stream only if that room still has a scatter in
flight, so the success path never stalls the scheduler behind other rooms.

A receiver uses the whole operations, from any thread: `open_room`, `offer` (ring
regions for the next segments, as far as the ring has space), `region_of`, `land`
(check what arrived, scatter it, check the pages, free the region) and
`close_room`. The steps they are made of (`assign_region`, `check_digests`,
`scatter`, `reap`) stay public for tests that drive one step at a time.

Fencing. A room closed before every writer notified (the request aborted, a timeout,
a bad digest, prefill failed) may still be written by prefill: the one-sided writes of
NIXL, Mooncake and same-host copies land whatever decode does. `close_room(fence=True)`
keeps the regions not yet landed assigned (`fenced`) until `release_fenced`, which the
caller calls once every writer that could write them confirmed it stopped; a fenced
region is live in the ring, so the watermark stops before it and nothing it overlays
is handed out again (the ring may fill meanwhile). Regions landed are the writers'
no more (each notified after its bytes) and are freed as usual.

The handler owns its ring's regions and its lock; pages belong to the caller's KV
pool. Handlers sharing one ring (one per prefill TP) must share one lock: the
allocator is then guarded once. Pages are checked in place (`kernels.slice_digests`).
It knows nothing of the protocol that carries offers and digests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from pdctl.staging import device as dev
from pdctl.staging.allocator import Region, Watermark
from pdctl.staging.buffer import StagingRing
from pdctl.staging.descriptors import offset_address
from pdctl.staging.digest import block_digests, first_mismatch
from pdctl.staging.kernels import (
    PageIndices,
    describe_kv,
    scatter_staging_to_kv,
    slice_digests,
    upload_pages,
)
from pdctl.staging.layout import Segment, StagingLayout

Digests = Sequence[Sequence[int]]  # per writer: [L0.K, L0.V, L1.K, ...] (per segment)


@dataclass(frozen=True)
class DigestMismatch:
    """Received bytes differ from what prefill gathered: where, first.

    `place` is "ring" when the bytes in the staging ring differ (the transfer), and
    "pages" when the ring was right but the KV pages hold something else (the scatter).
    """

    writer: int
    prefill_rank: int
    layer: int
    kv: str  # "K" or "V"
    place: Literal["ring", "pages"] = "ring"


@dataclass(frozen=True)
class LandFaults:
    """Faults injected on purpose while landing a room, so checks are proven to catch them."""

    skip_first_scatter: bool = False  # segment 0 stays in the ring: its pages keep stale KV


NO_FAULTS = LandFaults()


@dataclass(frozen=True)
class Offer:
    """A ring region assigned for one segment, and what a writer needs to know of it."""

    segment: Segment
    region: Region
    address: int  # unsigned: ring base + the region's physical offset
    watermark: Watermark  # the ring's watermark right after the assignment


@dataclass
class RoomState:
    room: int
    pages: torch.Tensor  # [num_pages] int64 on the KV device
    ready: Any  # event recorded after the req_to_token write
    faults: LandFaults = NO_FAULTS
    pending: list[tuple[Region, Any]] = field(default_factory=list)  # (region, scatter done)
    regions: list[Region] = field(default_factory=list)  # assigned, not yet freed
    offered: dict[int, Region] = field(default_factory=dict)  # segment index -> region


class DecodeStagingHandler:
    """Owns one decode rank's staging ring and orders scatters into its KV pages."""

    def __init__(
        self,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        *,
        page_size: int,
        ring: StagingRing,
        layout: StagingLayout,
        backend: str | None = None,
        lock: threading.RLock | None = None,
    ) -> None:
        info = describe_kv(k_buffers, v_buffers)
        self.device = info.device  # derived from the KV buffers, never passed in
        if self.device.type != "cpu" and self.device.index is None:
            raise ValueError(
                f"the decode staging handler needs an indexed device, got {self.device}"
            )
        if ring.buffer.device != self.device:
            raise ValueError(f"staging ring is on {ring.buffer.device} but KV is on {self.device}")
        self.k_buffers, self.v_buffers = list(k_buffers), list(v_buffers)
        self.info = info
        self.page_size = page_size
        self.ring = ring
        self.layout = layout
        self.backend = backend
        self.lock = lock if lock is not None else threading.RLock()  # shared with the ring's
        self.scatter_stream = dev.create_device_stream(self.device)
        self.rooms: dict[int, RoomState] = {}
        self.fenced: dict[int, list[Region]] = {}  # room -> regions a writer may still write

    # -- whole operations ------------------------------------------------------------
    def open_room(
        self,
        room: int,
        page_indices: PageIndices,
        scheduler_stream: Any = None,
        *,
        ready: Any = None,
        faults: LandFaults = NO_FAULTS,
    ) -> None:
        """Call right after the room's req_to_token row is written on `scheduler_stream`.

        A caller on another thread than the scheduler passes `ready` instead: the event
        the scheduler recorded right after that write (recording here would order the
        scatter after this thread's stream, not the scheduler's).
        """
        with self.lock:
            if room in self.rooms:
                raise ValueError(f"room {room} is already registered")
            if ready is None:
                ready = dev.create_device_event(self.device)
                ready.record(scheduler_stream)
            pages = upload_pages(page_indices, self.page_size, self.info)
            self.rooms[room] = RoomState(room, pages, ready, faults)

    def offer(self, room: int, plan: Sequence[Segment]) -> list[Offer]:
        """Regions for the next segments of `plan` not offered yet, while the ring has space.

        Regions whose scatter finished are freed first. Each segment is offered once.
        """
        with self.lock:
            state = self._state(room)
            self.reap(room)
            fresh: list[Offer] = []
            for segment in plan:
                if segment.index in state.offered:
                    continue
                region = self.assign_region(room, segment)
                if region is None:
                    break
                state.offered[segment.index] = region
                address = offset_address(self.ring.buffer.ptr, region.offset)
                fresh.append(Offer(segment, region, address, self.ring.allocator.watermark))
            return fresh

    def region_of(self, room: int, segment: Segment) -> Region | None:
        """The region offered for `segment` of the room (even once landed), or None yet."""
        with self.lock:
            return self._state(room).offered.get(segment.index)

    def land(self, room: int, segment: Segment, expected: Digests) -> DigestMismatch | None:
        """Land what every writer sent for `segment`: check the ring against `expected`,
        scatter into the room's pages (after its ready event), wait for the scatter,
        check the pages hold what the writers sent, and free the region.

        Returns where the first mismatch is (None: the KV is in the pages). The region
        is freed either way; the room stays open until `close_room`.
        """
        with self.lock:
            state = self._state(room)
            region = state.offered.get(segment.index)
            if region is None or region not in state.regions:
                raise ValueError(f"segment {segment.index} of room {room} holds no ring region")
            try:
                mismatch = self.check_digests(region, segment, expected)
                if mismatch is not None:
                    return mismatch
                if not (state.faults.skip_first_scatter and segment.index == 0):
                    self.scatter(room, region, segment)
                dev.synchronize_stream(self.scatter_stream)
                return self.check_pages(state.pages, (segment,), expected)
            finally:
                self.reap(room)  # the scatter is done: its region is freed here
                if region in state.regions and all(r != region for r, _ in state.pending):
                    self._free(state, region)  # never scattered (a mismatch, or a fault)

    def close_room(self, room: int, *, fence: bool = False) -> Watermark:
        """Forget the room and give back every region it holds (success or failure).

        With `fence`, the regions not yet landed stay assigned until `release_fenced`
        (see the module docstring); scatters in flight are drained either way."""
        with self.lock:
            state = self._state(room)
            if any(not done.query() for _, done in state.pending):
                dev.synchronize_stream(self.scatter_stream)
            for region, _ in state.pending:  # landed: their writers are done with them
                self._free(state, region)
            state.pending.clear()
            if fence and state.regions:
                self.fenced[room] = list(state.regions)
            else:
                for region in list(state.regions):
                    self._free(state, region)
            del self.rooms[room]
            return self.ring.allocator.watermark

    def release_fenced(self, room: int) -> int:
        """Every writer of `room` stopped: its fenced regions go back to the ring.
        Returns how many (0 for a room not fenced)."""
        with self.lock:
            regions = self.fenced.pop(room, [])
            for region in regions:
                self.ring.allocator.free(region)
            return len(regions)

    @property
    def num_fenced(self) -> int:
        """Regions fenced now (assigned in the ring, waiting for their writers)."""
        with self.lock:
            return sum(len(regions) for regions in self.fenced.values())

    def check_pages(
        self, pages: PageIndices, plan: Sequence[Segment], expected: Digests
    ) -> DigestMismatch | None:
        """Digest `plan`'s segments where they lie in `pages` (`slice_digests`, nothing
        gathered) and compare them with the writers' digests (`expected[w]`: every
        segment's, in order): proof that the KV landed in the pages, not only in the
        ring. Any page list, staged or written directly."""
        per_segment = 2 * self.info.num_layers
        spans = [(segment.page_start, segment.num_pages) for segment in plan]
        with self.lock:
            for writer, piece in enumerate(self.layout.slices):
                sent = list(expected[writer])
                if len(sent) != per_segment * len(plan):
                    return DigestMismatch(writer, piece.prefill_rank, 0, "K", "pages")
                landed = piece.destination(self.page_size)  # read in place (see kernels)
                found_in = slice_digests(
                    self.k_buffers, self.v_buffers, pages, spans, landed, self.backend
                )
                for number, received in enumerate(found_in):
                    found = first_mismatch(
                        sent[number * per_segment : (number + 1) * per_segment], received
                    )
                    if found is not None:
                        return DigestMismatch(writer, piece.prefill_rank, *found, "pages")
        return None

    # -- the steps -------------------------------------------------------------------
    def assign_region(self, room: int, segment: Segment) -> Region | None:
        """A ring region for one segment of the room, or None until the ring frees space."""
        with self.lock:
            state = self._state(room)
            region = self.ring.allocator.assign(self.layout.region_bytes(self._tokens(segment)))
            if region is not None:
                state.regions.append(region)
            return region

    def check_digests(
        self, region: Region, segment: Segment, expected: Digests
    ) -> DigestMismatch | None:
        """Compare each writer block's digests in the ring with the ones prefill sent."""
        with self.lock:
            view = self.ring.view(region)
            num_tokens = self._tokens(segment)
            for writer, piece in enumerate(self.layout.slices):
                start = self.layout.block_offset(writer, num_tokens)
                block = view[start : start + self.layout.block_bytes(writer, num_tokens)]
                found = first_mismatch(
                    list(expected[writer]), block_digests(block, self.info.num_layers)
                )
                if found is not None:
                    return DigestMismatch(writer, piece.prefill_rank, *found)
            return None

    def scatter(self, room: int, region: Region, segment: Segment) -> None:
        """Scatter a received region into the room's pages, after the room's ready event."""
        with self.lock:
            state = self._state(room)
            if region not in state.regions:
                raise ValueError(f"region at {region.start} does not belong to room {room}")
            pages = state.pages[segment.page_start : segment.page_start + segment.num_pages]
            dev.stream_wait_event(self.scatter_stream, state.ready)
            with dev.device_stream_context(self.scatter_stream):
                scatter_staging_to_kv(
                    self.ring.view(region),
                    self.k_buffers,
                    self.v_buffers,
                    pages,
                    page_size=self.page_size,
                    writers=self.layout.slices,
                    backend=self.backend,
                )
                done = dev.create_device_event(self.device)
                done.record(self.scatter_stream)
            state.pending.append((region, done))

    def reap(self, room: int) -> Watermark:
        """Free the room's regions whose scatter finished; returns the ring's watermark."""
        with self.lock:
            state = self._state(room)
            still: list[tuple[Region, Any]] = []
            for region, done in state.pending:
                if done.query():
                    self._free(state, region)
                else:
                    still.append((region, done))
            state.pending = still
            return self.ring.allocator.watermark

    def has_inflight(self, room: int) -> bool:
        with self.lock:
            return any(not done.query() for _, done in self._state(room).pending)

    # -- internals (the lock is held) ------------------------------------------------
    def _state(self, room: int) -> RoomState:
        try:
            return self.rooms[room]
        except KeyError:
            raise KeyError(f"room {room} is not registered on this decode rank") from None

    def _tokens(self, segment: Segment) -> int:
        return segment.num_tokens(self.page_size)

    def _free(self, state: RoomState, region: Region) -> None:
        state.regions.remove(region)
        self.ring.allocator.free(region)
