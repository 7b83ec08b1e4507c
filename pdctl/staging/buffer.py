"""Staging buffers: contiguous device memory that KV is gathered into or received in.

Prefill owns `StagingBuffer`s it gathers into before a transport reads them; each
decode rank owns one `StagingRing` (a buffer plus a `RingAllocator`) that prefill
writes into. The device is always explicit: `device_type` is a required keyword
with no default, so no backend can silently allocate staging on CUDA.

A buffer is registered with a transport by its owner; this module only allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdctl.staging import device as dev
from pdctl.staging.allocator import Region, RingAllocator
from pdctl.staging.descriptors import unsigned_ptr


class StagingBuffer:
    """One contiguous byte buffer on a device."""

    def __init__(self, size_bytes: int, device: torch.device) -> None:
        if size_bytes < 1:
            raise ValueError(f"staging buffer size must be >= 1 byte, got {size_bytes}")
        self.device = device
        self.tensor = torch.empty(size_bytes, dtype=torch.uint8, device=device)  # [size_bytes]
        self._gather_stream: object | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def ptr(self) -> int:
        """The base address as an unsigned 64-bit value (bit 63 may be set on XPU)."""
        return unsigned_ptr(self.tensor.data_ptr())

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the buffer, as a uint8 tensor."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"view [{offset}, {offset + nbytes}) is outside a staging buffer "
                f"of {self.nbytes} bytes"
            )
        return self.tensor.narrow(0, offset, nbytes)

    def producer_stream(self) -> object:
        """The stream that produced data for a transport, resolved per call.

        The current stream is thread-local and transfer workers run on their own
        threads, so it must never be cached.
        """
        return dev.current_device_stream(self.device)

    def gather_stream(self) -> object:
        """A dedicated stream for gathers, created on first use (decode never gathers)."""
        if self._gather_stream is None:
            self._gather_stream = dev.create_device_stream(self.device)
        return self._gather_stream

    @property
    def has_gather_stream(self) -> bool:
        return self._gather_stream is not None


def init_staging_buffers(
    size_bytes: int, num_buffers: int = 1, *, device_type: str, gpu_id: int | None = None
) -> list[StagingBuffer]:
    """Prefill side: `num_buffers` gather buffers of `size_bytes` on one device.

    `device_type` ("cuda", "xpu:1", "cpu", ...) is required; an index in it wins over
    `gpu_id`, with a warning when they differ.
    """
    device = dev.resolve_device(device_type, gpu_id)
    return [StagingBuffer(size_bytes, device) for _ in range(num_buffers)]


@dataclass
class StagingRing:
    """Decode side: one ring buffer and the allocator that hands out its regions."""

    buffer: StagingBuffer
    allocator: RingAllocator

    def view(self, region: Region) -> torch.Tensor:
        return self.buffer.view(region.offset, region.size)


def init_staging_allocator(
    size_bytes: int, *, device_type: str, gpu_id: int | None = None, overcommit_rounds: int = 1
) -> StagingRing:
    """Decode side: a ring of `size_bytes` on one device, with its allocator."""
    device = dev.resolve_device(device_type, gpu_id)
    return StagingRing(
        StagingBuffer(size_bytes, device),
        RingAllocator(size_bytes, overcommit_rounds=overcommit_rounds),
    )
