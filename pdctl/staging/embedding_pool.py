"""Encoder -> prefill embeddings: the receiving pool, a host wrapper, the send barrier.

`EmbeddingPool` is prefill's registered buffer for embeddings an encoder writes
with a transport; it is allocated on the runtime device type, never a hard-coded
"cuda:N". `TensorWrapper` carries a tensor as host bytes (copied from any non-CPU
device). `synchronize_before_send` is the barrier the encoder's `/send` path needs
on every accelerator: transports do not order against the device stream, so
without it a transport could read a buffer before the device's writes land.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.allocator import Region, RingAllocator
from pdctl.staging.buffer import StagingBuffer
from pdctl.staging.descriptors import tensor_ptr


@dataclass(frozen=True)
class EmbeddingSlot:
    region: Region
    num_tokens: int
    hidden_size: int
    dtype: torch.dtype


class EmbeddingPool:
    """A ring of device memory for incoming embeddings, one slot per request."""

    def __init__(self, *, device_type: str, gpu_id: int | None, size_bytes: int) -> None:
        self.device = dev.resolve_device(device_type, gpu_id)
        self.buffer = StagingBuffer(size_bytes, self.device)
        self.allocator = RingAllocator(size_bytes, overcommit_rounds=0)

    def allocate(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> EmbeddingSlot | None:
        """A slot for [num_tokens, hidden_size] of `dtype`, or None while the pool is full."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = num_tokens * hidden_size * itemsize
        region = self.allocator.assign(nbytes + (-nbytes) % 16)  # 16-byte aligned slots
        return None if region is None else EmbeddingSlot(region, num_tokens, hidden_size, dtype)

    def view(self, slot: EmbeddingSlot) -> torch.Tensor:
        """The slot's embeddings: [num_tokens, hidden_size] of the slot's dtype."""
        itemsize = torch.empty((), dtype=slot.dtype).element_size()
        raw = self.buffer.view(slot.region.offset, slot.num_tokens * slot.hidden_size * itemsize)
        return raw.view(slot.dtype).view(slot.num_tokens, slot.hidden_size)

    def address(self, slot: EmbeddingSlot) -> int:
        return self.buffer.ptr + slot.region.offset

    def free(self, slot: EmbeddingSlot) -> None:
        self.allocator.free(slot.region)


class TensorWrapper:
    """A tensor as host bytes plus dtype and shape; copies from any non-CPU device."""

    def __init__(self, tensor: torch.Tensor) -> None:
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")  # every accelerator, not only CUDA
        self.tensor = host.contiguous()

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def to_bytes(self) -> bytes:
        return self.tensor.reshape(-1).view(torch.uint8).numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorWrapper:
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        return cls(raw.view(dtype).reshape(shape))

    def to(self, device: torch.device | str) -> torch.Tensor:
        return self.tensor.to(device)


def synchronize_before_send(tensor: torch.Tensor) -> tuple[int, int]:
    """Wait for the device's writes to `tensor`, then return (address, nbytes) for a transport."""
    if tensor.device.type != "cpu":
        dev.synchronize(tensor.device)
    return tensor_ptr(tensor), tensor.numel() * tensor.element_size()
