"""A peer's KV pool as tensors of this process, where the transport maps its memory.

A direct write needs the peer's buffers only as addresses for descriptors; where
the transport maps the peer's device memory here (`Transport.mapped_view`, same-host
device IPC), a kernel can write them itself (`kernels.page_write`), its digests in
the same read. This module turns a registration's buffer addresses into those
tensors, once per peer and pool: [pool_tokens, heads, head_dim] of the KV dtype,
each bounded by the region the peer registered for it, so no page id can reach
past the buffer it names.

What this does not know: how the memory was mapped, and what is written into it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdctl.staging.transport import Peer, Transport


class MappedPools:
    """Per peer and buffer list, the peer's KV buffers as tensors here (None: not mapped)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._pools: dict[tuple[object, ...], list[torch.Tensor] | None] = {}
        self._lock = threading.Lock()

    def buffers(
        self,
        peer: Peer,
        bases: Sequence[int],
        heads: int,
        head_dim: int,
        like: torch.Tensor,
    ) -> list[torch.Tensor] | None:
        """The buffers at `bases` (staging order k0, v0, k1, ...) of `heads` x `head_dim`
        rows of `like`'s dtype, on `like`'s device; None where the transport maps none
        of them here or they are not whole rows of that shape."""
        key = (peer.address, tuple(bases), heads, head_dim, like.dtype, like.device)
        with self._lock:
            if key in self._pools:
                return self._pools[key]
        pool = self._open(peer, bases, heads * head_dim * like.element_size(), like)
        if pool is not None:
            pool = [b.view(b.shape[0], heads, head_dim) for b in pool]
        with self._lock:
            if len(self._pools) >= 256:
                self._pools.pop(next(iter(self._pools)))
            self._pools[key] = pool
        return pool

    def _open(
        self, peer: Peer, bases: Sequence[int], row_bytes: int, like: torch.Tensor
    ) -> list[torch.Tensor] | None:
        raws = []
        for base in bases:
            raw = self.transport.mapped_view(peer, int(base))
            if raw is None or raw.device != like.device or row_bytes <= 0:
                return None
            if raw.data_ptr() % like.element_size():
                return None
            raws.append(raw)
        # Every buffer as long as the shortest: a buffer registered as its own region
        # (as decode registers its pool) is exactly that long; one inside a larger
        # region is cut there, never reaching past the region it lies in.
        rows = min(raw.numel() for raw in raws) // row_bytes
        if rows == 0:
            return None
        return [raw[: rows * row_bytes].view(like.dtype).view(rows, -1) for raw in raws]
