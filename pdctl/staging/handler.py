"""Decode side of a staged transfer: rooms, ring regions, ordered scatters, release.

Ordering, per room (a request's KV transfer):

    scheduler stream:  alloc pages, write req_to_token row, record E(room)
    scatter stream:    wait E(room)  ->  scatter region into pages  ->  record D
    host:              D complete    ->  free region, advance the watermark

The scatter waits on the room's event, not on the scheduler stream: waiting on the
stream would also queue the scatter behind whatever forward runs there. Releasing
a room drains the (shared) scatter stream only if that room still has a scatter in
flight, so the success path never stalls the scheduler behind other rooms.

The handler owns its ring's regions; pages belong to the caller's KV pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdctl.staging import device as dev
from pdctl.staging.allocator import Region, Watermark
from pdctl.staging.buffer import StagingRing
from pdctl.staging.digest import block_digests, first_mismatch
from pdctl.staging.kernels import PageIndices, describe_kv, scatter_staging_to_kv, upload_pages
from pdctl.staging.layout import Segment, StagingLayout


@dataclass(frozen=True)
class DigestMismatch:
    """Received bytes differ from what prefill gathered: where, first."""

    writer: int
    prefill_rank: int
    layer: int
    kv: str  # "K" or "V"


@dataclass
class RoomState:
    room: int
    pages: torch.Tensor  # [num_pages] int64 on the KV device
    ready: Any  # event recorded after the req_to_token write
    pending: list[tuple[Region, Any]] = field(default_factory=list)  # (region, scatter done)
    regions: list[Region] = field(default_factory=list)  # assigned, not yet freed


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
        self.scatter_stream = dev.create_device_stream(self.device)
        self.rooms: dict[int, RoomState] = {}

    def register_room(
        self,
        room: int,
        page_indices: PageIndices,
        scheduler_stream: Any = None,
        *,
        ready: Any = None,
    ) -> RoomState:
        """Call right after the room's req_to_token row is written on `scheduler_stream`.

        A caller on another thread than the scheduler passes `ready` instead: the event
        the scheduler recorded right after that write (recording here would order the
        scatter after this thread's stream, not the scheduler's).
        """
        if room in self.rooms:
            raise ValueError(f"room {room} is already registered")
        if ready is None:
            ready = dev.create_device_event(self.device)
            ready.record(scheduler_stream)
        pages = upload_pages(page_indices, self.page_size, self.info)
        state = RoomState(room, pages, ready)
        self.rooms[room] = state
        return state

    def _state(self, room: int) -> RoomState:
        try:
            return self.rooms[room]
        except KeyError:
            raise KeyError(f"room {room} is not registered on this decode rank") from None

    def assign_region(self, room: int, segment: Segment) -> Region | None:
        """A ring region for one segment of the room, or None until the ring frees space."""
        state = self._state(room)
        nbytes = self.layout.region_bytes(segment.num_tokens(self.page_size))
        region = self.ring.allocator.assign(nbytes)
        if region is not None:
            state.regions.append(region)
        return region

    def check_digests(
        self, region: Region, segment: Segment, expected: Sequence[Sequence[int]]
    ) -> DigestMismatch | None:
        """Compare each writer block's digests with the ones prefill sent."""
        view = self.ring.view(region)
        num_tokens = segment.num_tokens(self.page_size)
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
        return any(not done.query() for _, done in self._state(room).pending)

    def release_room(self, room: int) -> Watermark:
        """Forget the room and give back every region it holds (success or failure)."""
        state = self._state(room)
        if any(not done.query() for _, done in state.pending):
            dev.synchronize_stream(self.scatter_stream)
        for region in list(state.regions):
            self._free(state, region)
        state.pending.clear()
        del self.rooms[room]
        return self.ring.allocator.watermark

    def _free(self, state: RoomState, region: Region) -> None:
        state.regions.remove(region)
        self.ring.allocator.free(region)
