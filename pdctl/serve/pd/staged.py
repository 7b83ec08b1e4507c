"""A staged room's write to one decode rank: through decode's staging ring.

For every segment of the room (decode's segment size): wait until decode offers a
ring region (its watermark must show the region free), gather this writer's head slice
of the segment's pages into a staging buffer, digest it, and write it at this
writer's block offset in the region, the notification with the digests riding the
write. Staging buffers come from a small pool (`StagingBuffers`), each held from a
gather until its write is done.

What this does not know: faults (they wrap the link it writes through,
`write_faults`), other decode ranks.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.waits import RoomWaits, SendFailed
from pdctl.serve.pd.writes import KvWrite, Link, RoomWrite, SendClock, Written
from pdctl.staging import device as dev
from pdctl.staging.buffer import StagingBuffer, init_staging_buffers
from pdctl.staging.descriptors import block_address
from pdctl.staging.digest import block_digests
from pdctl.staging.kernels import gather_slice
from pdctl.staging.layout import HeadSlice, Segment, plan_segments
from pdctl.staging.transport import Transport


class StagingBuffers:
    """Prefill's staging buffers, registered with the transport: one is held for a
    gather and the write that reads it."""

    def __init__(
        self, transport: Transport, segment_bytes: int, count: int, device: torch.device
    ) -> None:
        self.segment_bytes = segment_bytes
        self._free: queue.SimpleQueue[StagingBuffer] = queue.SimpleQueue()
        for buffer in init_staging_buffers(
            segment_bytes, count, device_type=device.type, gpu_id=device.index
        ):
            transport.register_tensor(buffer.tensor)
            self._free.put(buffer)

    @contextmanager
    def held(self) -> Iterator[StagingBuffer]:
        buffer = self._free.get()
        try:
            yield buffer
        finally:
            self._free.put(buffer)


class StagedWrite(KvWrite):
    def __init__(self, rank: int, kv: KVPool, buffers: StagingBuffers, waits: RoomWaits):
        self.rank, self.kv, self.buffers, self.waits = rank, kv, buffers, waits

    def write(self, target: RoomWrite, link: Link, clock: SendClock) -> Written:
        room, reg, page_size = target.room, target.reg, self.kv.page_size
        piece = target.layout.slices[target.writer]
        sent, waited = 0, 0.0
        plan = self._plan(target)
        for segment in plan:
            started = time.perf_counter()
            region = self.waits.region(room, reg.decode_rank, segment.index)
            waited += time.perf_counter() - started
            if not region.writable():
                raise SendFailed(
                    f"decode rank {reg.decode_rank} offered a region its watermark has not freed"
                )
            chunk = target.pages[segment.page_start : segment.page_start + segment.num_pages]
            num_tokens = segment.num_tokens(page_size)
            address = block_address(region.address, target.layout, target.writer, num_tokens)
            with self.buffers.held() as buffer:
                nbytes, digests = self._gather(buffer, chunk, piece, clock)
                message = proto.notify_message(room, segment.index, self.rank, digests, nbytes)
                link.put(buffer, nbytes, address, message)
            sent += nbytes
        return Written(sent, len(plan), waited)

    def _plan(self, target: RoomWrite) -> tuple[Segment, ...]:
        """Decode's segments (its segment size), each checked to fit a staging buffer here."""
        reg, layout, page_size = target.reg, target.layout, self.kv.page_size
        plan = plan_segments(
            len(target.pages), page_size, layout.bytes_per_token(), reg.segment_bytes
        )
        writers = range(len(layout.slices))
        needed = max(layout.block_bytes(w, s.num_tokens(page_size)) for s in plan for w in writers)
        have = self.buffers.segment_bytes
        if needed > have:
            raise SendFailed(
                f"decode rank {reg.decode_rank} cuts rooms into segments of "
                f"{reg.segment_bytes / (1 << 20):g} MiB, which needs a {needed / (1 << 20):g} MiB "
                f"staging buffer on prefill (it has {have / (1 << 20):g} MiB); "
                "give both roles the same --staging-segment-mb"
            )
        return plan

    def _gather(
        self, buffer: StagingBuffer, pages: list[int], piece: HeadSlice, clock: SendClock
    ) -> tuple[int, list[int]]:
        started = time.perf_counter()
        kv, staging = self.kv, buffer.tensor
        nbytes = gather_slice(
            kv.k_buffers, kv.v_buffers, pages, staging, piece.source(kv.page_size)
        )
        dev.synchronize_stream(buffer.producer_stream())  # the transport reads next
        gathered = time.perf_counter()
        digests = block_digests(buffer.view(0, nbytes), len(self.kv.k_buffers))
        clock.gather += gathered - started
        clock.digest += time.perf_counter() - gathered
        return nbytes, digests
