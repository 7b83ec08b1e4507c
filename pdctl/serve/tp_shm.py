"""The TP all-gather of small host tensors through shared memory, for ranks of one host.

A decode step gathers each layer's row-parallel partials twice; through gloo each
gather is a TCP round trip on loopback with its own threads (about 250 us on a
small CPU), while the payload is a few KiB. Here each rank copies its partial into
its slot of a shared file, publishes a sequence number, and waits (futex: the
waiting rank sleeps in the kernel, no spinning on a shared core) until every rank
published the same number; then all slots are read in rank order. The bytes are
the ones gloo would deliver, so results are bit-identical.

    file:  header [world x 64 B: int32 sequence]  | slots [2 parities][world][capacity]

Two slot sets alternate by the sequence's parity: a rank writes the set of call n
only after every rank published n - 1, which each does after reading the set of
n - 2, so no slot is written while another rank may still read it. Payloads larger
than a slot go through the caller's collective (every rank makes the same choice:
the shapes are equal on all ranks).

What this does not know: the model, or which ranks are alive (a dead rank shows as a
timeout, reported as an error naming the rank).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time

import torch

from pdctl.staging import futex

HEADER_STRIDE = 64  # one cache line per rank's sequence word
SLOT_BYTES = 1 << 20  # per rank and parity: decode batches of partials fit easily
SPIN_S = 20e-6  # a rank that arrives last finds the others there at once


def available() -> bool:
    """Futexes on this machine (Linux on x86_64 or aarch64) and a /dev/shm to share."""
    return futex.available() and os.path.isdir("/dev/shm")


def file_size(world: int) -> int:
    return world * HEADER_STRIDE + 2 * world * SLOT_BYTES


class SharedGather:
    """One rank's end of the shared file at `path` (rank 0 created it, sized)."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, file_size(world))
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole file
        self._words = [
            ctypes.c_int32.from_buffer(self._map, r * HEADER_STRIDE) for r in range(world)
        ]
        self._count = 0

    @staticmethod
    def create(path: str, world: int) -> None:
        """Rank 0: the zeroed file (sequence 0 everywhere), before the others open it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, file_size(world))
        finally:
            os.close(fd)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local` (same shape and dtype on all), concatenated in rank order."""
        local = local.contiguous()
        nbytes = local.numel() * local.element_size()
        self._count += 1
        sequence = self._count
        parity = sequence % 2
        self._slot(parity, self.rank, nbytes).copy_(local.view(-1).view(torch.uint8))
        self._words[self.rank].value = sequence  # after the bytes (stores stay in order)
        self._wake(self.rank)
        for other in range(self.world):
            if other != self.rank:
                self._wait(other, sequence)
        parts = [self._slot(parity, r, nbytes) for r in range(self.world)]
        gathered = torch.cat(parts).view(local.dtype)  # a copy: the slots are reused
        return gathered.view(self.world * local.shape[0], *local.shape[1:])

    def broadcast(self, message: torch.Tensor | None, last: bool = False) -> torch.Tensor | None:
        """Rank 0's int64 `message` on every rank (the others pass None): one call of
        the same sequence as `gather`, in the same order on every rank. Rank 0 writes
        its slot and returns once every rank read it (so the slot parity rule holds);
        the others wait for it without a deadline (a worker idles here between steps;
        it dies with rank 0). None on every rank where the message does not fit a
        slot: the caller sends it another way. `last`: rank 0 sends nothing after it (a
        stop), so it returns without waiting for the others, who may be gone."""
        self._count += 1
        sequence = self._count
        parity = sequence % 2
        size = self._slot(parity, 0, 8).view(torch.int64)  # [1]: the message's int64s
        if self.rank == 0:
            assert message is not None
            words = message.to(torch.int64).contiguous().view(-1)
            fits = (words.numel() + 1) * 8 <= SLOT_BYTES
            size[0] = words.numel() if fits else -1
            if fits:
                self._slot(parity, 0, 8 + words.numel() * 8)[8:].copy_(words.view(torch.uint8))
            self._words[0].value = sequence  # after the bytes (stores stay in order)
            self._wake(0)
            if not last:
                for other in range(1, self.world):
                    self._wait(other, sequence)
            return words if fits else None
        self._wait(0, sequence, limit_s=float("inf"))
        count = int(size[0])
        received = None
        if count >= 0:
            received = self._slot(parity, 0, 8 + count * 8)[8:].view(torch.int64).clone()
        self._words[self.rank].value = sequence  # read: rank 0 may go on
        self._wake(self.rank)
        return received

    def _slot(self, parity: int, rank: int, nbytes: int) -> torch.Tensor:
        start = self.world * HEADER_STRIDE + (parity * self.world + rank) * SLOT_BYTES
        return self._bytes[start : start + nbytes]

    def _wake(self, rank: int) -> None:
        futex.wake(ctypes.addressof(self._words[rank]))

    def _wait(self, rank: int, sequence: int, limit_s: float | None = None) -> None:
        """Until `rank` published `sequence`; past `limit_s` (default timeout_s) a
        TimeoutError naming it."""
        word = self._words[rank]
        spin_until = time.perf_counter() + SPIN_S
        while word.value < sequence and time.perf_counter() < spin_until:
            pass
        start = time.monotonic()
        limit = start + (self.timeout_s if limit_s is None else limit_s)
        address = ctypes.addressof(word)
        while True:
            seen = word.value
            if seen >= sequence:
                return
            if time.monotonic() > limit:
                raise TimeoutError(
                    f"TP rank {rank} did not reach gather {sequence} within {limit - start:g} s "
                    f"(it is at {seen})"
                )
            futex.wait(address, seen, 0.2)  # re-checks at least every 0.2 s

    def close(self) -> None:
        self._words.clear()
        del self._bytes
        with contextlib.suppress(BufferError):  # still viewed: the OS unmaps it at exit
            self._map.close()
        if self.rank == 0:
            unlink(self.path)


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
