"""Encoder -> prefill embeddings: prefill's side of the exchange.

Prefill rank 0 holds an `EmbeddingPool` registered with its transport. For each
multimodal request the encoder (1) asks prefill's bootstrap endpoint for a slot
(`POST /bootstrap/embedding/alloc`: room, rows, hidden size, dtype -> prefill's
transport description and the slot's address), (2) writes the embeddings there with
the topology's transport, (3) says so (`POST /bootstrap/embedding/sent`: room and the
digest of what it wrote). Prefill digests the slot and refuses a mismatch (the bytes
did not arrive as sent). The router then sends the request to prefill with
`embedding_room`; prefill takes the rows out of the slot (freeing it) and splices
them into the prompt. A slot nobody takes within the expiry is freed.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass, field

import torch

from pdctl.serve.model.weights import DTYPES
from pdctl.serve.multimodal import digest_of
from pdctl.serve.pd.protocol import BootstrapError
from pdctl.staging.allocator import RegionTooLarge
from pdctl.staging.embedding_pool import EmbeddingPool, EmbeddingSlot
from pdctl.staging.transport import Transport


class EmbeddingError(BootstrapError):
    """An embedding exchange refused (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message, status)


@dataclass
class _Entry:
    slot: EmbeddingSlot
    created: float = field(default_factory=time.monotonic)
    arrived: bool = False


class EmbeddingReceiver:
    def __init__(
        self, pool: EmbeddingPool, transport: Transport, hidden_size: int, expiry_s: float
    ) -> None:
        self.pool, self.transport = pool, transport
        self.hidden_size, self.expiry_s = hidden_size, expiry_s
        self.region = transport.register(
            pool.buffer.ptr,
            pool.buffer.nbytes,
            device_type=pool.device.type,
            device_index=pool.device.index,
        )
        self.entries: dict[int, _Entry] = {}
        self.lock = threading.Lock()
        self.received = {"rooms": 0, "bytes": 0, "refused": 0}

    def _expire(self) -> None:
        now = time.monotonic()
        for room, entry in list(self.entries.items()):
            if now - entry.created > self.expiry_s:
                self.pool.free(entry.slot)
                del self.entries[room]

    def alloc(self, room: int, num_tokens: int, hidden: int, dtype: str) -> dict[str, str | int]:
        if hidden != self.hidden_size:
            raise EmbeddingError(f"hidden size {hidden}, but this model's is {self.hidden_size}")
        if dtype not in DTYPES:
            raise EmbeddingError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if not 0 < num_tokens <= 1 << 16:
            raise EmbeddingError(f"num_tokens {num_tokens} is out of range")
        with self.lock:
            self._expire()
            if room in self.entries:
                raise EmbeddingError(f"embedding room {room} is already taken", status=409)
            try:
                slot = self.pool.allocate(num_tokens, hidden, DTYPES[dtype])
            except RegionTooLarge:
                raise EmbeddingError(
                    f"{num_tokens} x {hidden} {dtype} does not fit the embedding pool "
                    f"({self.pool.buffer.nbytes} bytes)",
                    status=413,
                ) from None
            if slot is None:
                raise EmbeddingError("the embedding pool is full; retry", status=503)
            self.entries[room] = _Entry(slot)
        return {
            "transport": base64.b64encode(self.transport.describe()).decode(),
            "ptr": self.pool.address(slot),
            "bytes": num_tokens * hidden * DTYPES[dtype].itemsize,
        }

    def sent(self, room: int, digest: int) -> None:
        with self.lock:
            entry = self.entries.get(room)
            if entry is None:
                raise EmbeddingError(f"embedding room {room} is unknown or expired", status=410)
        received = digest_of(self.pool.view(entry.slot))
        if received != digest:
            with self.lock:
                self.entries.pop(room, None)
                self.pool.free(entry.slot)
                self.received["refused"] += 1
            raise EmbeddingError(
                f"embedding corruption in room {room}: the encoder sent digest {digest:#018x}, "
                f"prefill received {received:#018x}",
                status=409,
            )
        with self.lock:
            entry.arrived = True

    def take(self, room: int) -> torch.Tensor:
        """The room's embeddings (a copy; the slot is freed). Raises if they never arrived."""
        with self.lock:
            entry = self.entries.get(room)
            if entry is None or not entry.arrived:
                raise EmbeddingError(
                    f"no embeddings arrived for embedding room {room} (did the encoder fail?)"
                )
            del self.entries[room]
            rows = self.pool.view(entry.slot).clone()
            self.pool.free(entry.slot)
            self.received["rooms"] += 1
            self.received["bytes"] += rows.numel() * rows.element_size()
        return rows

    def state(self) -> dict[str, int]:
        with self.lock:
            return {"open": len(self.entries), **self.received}

    def close(self) -> None:
        self.transport.deregister(self.region)
