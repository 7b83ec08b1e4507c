"""Doorbells: a writer on the same host tells a receiver that its bytes landed by a
store into shared memory, not by a message.

A notification through a socket costs the writer's host a few hundred microseconds
on a busy server (the message, the system call, the GIL), longer than the device
needs to copy a request's KV. Here the receiver owns a box of slots in shared memory
(a memfd, opened by the writer through /proc); it hands each write a ticket (a slot
and a sequence number never used before in this box) with its registration, and the
writer rings the slot: the values the receiver checks (the write's digests, or the
digest sums it finalises itself), a check word, and last the sequence number. A
device rings it from the write's own launch (`kernels.bell`, into the box mapped for
the device), so nothing on the writer's host stands between the bytes landing and the
receiver being told; a host rings it with plain stores (`BellRinger.ring`).

    box:  header [8 words: magic, nonce, 0, slots, slot words, 0 ...]
          slot i at 8 + i * slot_words words:
            [0] seq       written last (by the device or the host)
            [1] check     mix of seq, count, kind and the values (a torn read fails it)
            [2] count     values that follow
            [3] kind      DIGESTS (final) or SUMS (the receiver finalises them)
            [4] announce  low 32 bits of the seq under way (host; a futex word)
            [8 ...]       values (int64)

The receiver sleeps on the slot's announce word (a futex: the writer's host wakes it
when it rings, or when it launched a device ring), then polls for the sequence
number in short sleeps until the device's stores arrived. Stores from a device to
host memory may become visible in any order: a slot is read as rung only when its
check word matches everything else read, so a half-visible ring is read again, never
taken. A slot is reused only after its last ticket was read, or RECLAIM_S after it
was given up (`quarantine`: a late ring may still come, and can reach no other write
while no writer could still be writing).

What this does not know: what the values mean, or how the writer's bytes travel.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import torch

from pdctl.staging import futex, hostmap

MAGIC = 0x70646374_6C62656C  # "pdctlbel"
HEADER_WORDS = 8
SLOT_HEADER = 8
SEQ, CHECK, COUNT, KIND, ANNOUNCE = 0, 1, 2, 3, 4
DIGESTS, SUMS = 0, 1
# The check word's odd multipliers (below 2**31: the Triton ring computes it as int64)
CHECK_SEQ, CHECK_COUNT, CHECK_KIND = 0x2545F491, 0x6C8E9CF5, 0x1B873593
POLL_S = 25e-6  # a ring under way (announced): how often the receiver looks
RECLAIM_S = 600.0  # a given-up slot returns after this long (no writer waits so long)


class BoxJson(TypedDict):
    """A `BoxInfo` as JSON (`BoxInfo.from_json` reads it back, every field checked)."""

    path: str
    nonce: int
    slots: int
    slot_words: int


@dataclass(frozen=True)
class BoxInfo:
    """Where a ringer finds a receiver's box: a path it opens, the nonce that proves
    it opened that box (a path can name another file on another host), its shape."""

    path: str
    nonce: int
    slots: int
    slot_words: int

    def to_json(self) -> BoxJson:
        return BoxJson(
            path=self.path, nonce=self.nonce, slots=self.slots, slot_words=self.slot_words
        )

    @staticmethod
    def from_json(data: Any) -> BoxInfo:
        """A box from JSON, every field checked (ValueError names it)."""
        if not isinstance(data, dict) or set(data) != {"path", "nonce", "slots", "slot_words"}:
            raise ValueError("a bell box has exactly the fields path, nonce, slots, slot_words")
        if not isinstance(data["path"], str) or not 0 < len(data["path"]) <= 4096:
            raise ValueError("a bell box's path must be text")
        for name, high in (("nonce", 1 << 64), ("slots", 1 << 16), ("slot_words", 1 << 20)):
            value = data[name]
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < high:
                raise ValueError(f"a bell box's {name} must be an integer below {high}")
        if data["slot_words"] <= SLOT_HEADER:
            raise ValueError("a bell box's slots must hold values")
        return BoxInfo(data["path"], data["nonce"], data["slots"], data["slot_words"])

    @property
    def nbytes(self) -> int:
        return 8 * (HEADER_WORDS + self.slots * self.slot_words)

    @property
    def capacity(self) -> int:
        """Values one slot holds."""
        return self.slot_words - SLOT_HEADER


@dataclass(frozen=True)
class Ticket:
    """One write's ring: the slot and the sequence number it must carry."""

    slot: int
    seq: int


def check_word(seq: int, kind: int, values: np.ndarray) -> int:
    """The mix a rung slot carries (modulo 2**64), as the Triton ring computes it."""
    weights = np.arange(len(values), dtype=np.uint64) * np.uint64(2) + np.uint64(3)
    with np.errstate(over="ignore"):
        total = int((values.astype(np.int64).view(np.uint64) * weights).sum(dtype=np.uint64))
    mix = seq * CHECK_SEQ + len(values) * CHECK_COUNT + kind * CHECK_KIND
    return (total + mix) & ((1 << 64) - 1)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _header(info: BoxInfo) -> list[int]:
    """The box's first words: what its receiver writes and a ringer checks."""
    return [_signed(MAGIC), info.nonce, 0, info.slots, info.slot_words]


class _Mapped:
    """A box's memory in this process: its words, the slots' addresses."""

    def __init__(self, fd: int, info: BoxInfo) -> None:
        self.info = info
        self.map = mmap.mmap(fd, info.nbytes)
        self.words = np.frombuffer(self.map, dtype=np.int64)
        self.address = _address(self.map)

    def base(self, slot: int) -> int:
        if not 0 <= slot < self.info.slots:
            raise ValueError(f"bell slot {slot} is outside the box's {self.info.slots}")
        return HEADER_WORDS + slot * self.info.slot_words

    def slot_address(self, slot: int) -> int:
        return self.address + 8 * self.base(slot)

    def announce_address(self, slot: int) -> int:
        return self.slot_address(slot) + 8 * ANNOUNCE

    def close(self) -> None:
        del self.words
        with contextlib.suppress(BufferError):  # still viewed: the OS unmaps it at exit
            self.map.close()


def _address(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


class BellBox:
    """The receiver's box: tickets out, rings read. Thread-safe."""

    def __init__(self, slots: int, capacity: int) -> None:
        if slots < 1 or capacity < 1:
            raise ValueError("a bell box needs at least one slot of one value")
        self._fd = os.memfd_create("pdctl-bells", os.MFD_CLOEXEC)
        nonce = secrets.randbits(63)
        self.info = BoxInfo(
            f"/proc/{os.getpid()}/fd/{self._fd}", nonce, slots, SLOT_HEADER + capacity
        )
        os.ftruncate(self._fd, self.info.nbytes)
        self._mapped = _Mapped(self._fd, self.info)
        header = _header(self.info)
        self._mapped.words[: len(header)] = header
        self._lock = threading.Lock()
        self._free = list(range(slots))
        self._given_up: list[tuple[float, int]] = []  # (when, slot), oldest first
        self._next_seq = 1

    @property
    def capacity(self) -> int:
        return self.info.capacity

    def ticket(self) -> Ticket | None:
        """A free slot with a new sequence number (None: every slot is in use)."""
        with self._lock:
            now = time.monotonic()
            while self._given_up and now - self._given_up[0][0] >= RECLAIM_S:
                self._free.append(self._given_up.pop(0)[1])
            if not self._free:
                return None
            slot, seq = self._free.pop(0), self._next_seq
            self._next_seq += 1
            return Ticket(slot, seq)

    def release(self, ticket: Ticket) -> None:
        """The ticket's ring was read: its slot may carry another."""
        with self._lock:
            self._free.append(ticket.slot)

    def quarantine(self, ticket: Ticket) -> None:
        """The ticket was given up before its ring was read: a late ring may still
        come, so its slot is handed out again only after RECLAIM_S, when no writer
        can still be writing."""
        with self._lock:
            self._given_up.append((time.monotonic(), ticket.slot))

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def read(self, ticket: Ticket) -> tuple[int, np.ndarray] | None:
        """(kind, values) once the slot rang with this ticket's sequence number and
        reads whole (None before, or while the ring's stores are still arriving)."""
        words, base = self._mapped.words, self._mapped.base(ticket.slot)
        if int(words[base + SEQ]) != ticket.seq:
            return None
        count, kind = int(words[base + COUNT]), int(words[base + KIND])
        if not 0 <= count <= self.info.capacity or kind not in (DIGESTS, SUMS):
            return None
        values = words[base + SLOT_HEADER : base + SLOT_HEADER + count].copy()
        check = int(words[base + CHECK]) & ((1 << 64) - 1)
        if check != check_word(ticket.seq, kind, values) or int(words[base + SEQ]) != ticket.seq:
            return None
        return kind, values

    def wait(self, ticket: Ticket, timeout_s: float) -> tuple[int, np.ndarray] | None:
        """`read` once it succeeds, or None after `timeout_s`. Sleeps on the slot's
        announce word until the ringer's host says the ring is under way, then looks
        every POLL_S until its stores arrived."""
        futex.fine_timer_slack()
        deadline = time.monotonic() + timeout_s
        address = self._mapped.announce_address(ticket.slot)
        announce = self._mapped.base(ticket.slot) + ANNOUNCE
        low = ticket.seq & 0xFFFFFFFF
        while True:
            rung = self.read(ticket)
            if rung is not None:
                return rung
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            seen = int(self._mapped.words[announce]) & 0xFFFFFFFF
            # announced, or its seq already there with the rest still arriving
            under_way = seen == low or int(self._mapped.words[announce - ANNOUNCE]) == ticket.seq
            futex.wait(address, seen, min(remaining, POLL_S if under_way else remaining))

    def close(self) -> None:
        self._mapped.close()
        os.close(self._fd)

    def __enter__(self) -> BellBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BellRinger:
    """A writer's end of a receiver's box (opened through its path, the nonce checked)."""

    def __init__(self, info: BoxInfo) -> None:
        fd = os.open(info.path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != info.nbytes:
                raise OSError(f"{info.path} is not a bell box of {info.nbytes} bytes")
            self._mapped = _Mapped(fd, info)
        finally:
            os.close(fd)
        header = _header(info)
        if self._mapped.words[: len(header)].tolist() != header:
            self._mapped.close()
            raise OSError(f"{info.path} is another box than the receiver's (nonce differs)")
        self.info = info

    def ring(self, ticket: Ticket, kind: int, values: list[int] | np.ndarray) -> None:
        """Ring from the host: the values, the check, the sequence number last, then
        the announcement and a wake."""
        array = np.asarray([_signed(v) for v in values] if isinstance(values, list) else values)
        array = array.astype(np.int64, copy=False)
        if len(array) > self.info.capacity:
            raise ValueError(f"{len(array)} values do not fit a bell slot of {self.info.capacity}")
        words, base = self._mapped.words, self._mapped.base(ticket.slot)
        words[base + SLOT_HEADER : base + SLOT_HEADER + len(array)] = array
        words[base + COUNT], words[base + KIND] = len(array), kind
        words[base + CHECK] = _signed(check_word(ticket.seq, kind, array))
        words[base + SEQ] = ticket.seq  # stores stay in order on the host (x86, and the
        self.announce(ticket)  # receiver's check word covers any other order)

    def announce(self, ticket: Ticket) -> None:
        """Tell the receiver the ring is under way (after a device ring's launch): it
        wakes and looks every POLL_S instead of sleeping."""
        base = self._mapped.base(ticket.slot)
        self._mapped.words[base + ANNOUNCE] = ticket.seq & 0xFFFFFFFF
        futex.wake(self._mapped.announce_address(ticket.slot))

    def slot_address(self, slot: int) -> int:
        """The slot's host address in this process."""
        return self._mapped.slot_address(slot)

    def device_slot(self, slot: int, device: torch.device) -> int | None:
        """The slot's address for kernels on `device` (the box mapped there once,
        `hostmap`), or None where the device cannot store into host memory here (the
        host rings)."""
        offset = self.slot_address(slot) - self._mapped.address
        base = hostmap.device_address(self._mapped.address, self.info.nbytes, device)
        return None if base is None else base + offset

    def close(self) -> None:
        hostmap.forget(self._mapped.address)  # before the memory goes
        self._mapped.close()

    def __enter__(self) -> BellRinger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe() -> tuple[bool, str]:
    """Whether doorbells work here: a box made, opened again through its path as a
    ringer would, rung and read back. (True, how) or (False, why not)."""
    if not futex.available():
        return False, "no futexes on this machine (Linux on x86_64 or aarch64 only)"
    try:
        box = BellBox(1, 1)
    except OSError as exc:
        return False, f"no shared memory for a box: {exc}"
    with box:
        ticket = box.ticket()
        assert ticket is not None
        try:
            with BellRinger(box.info) as ringer:
                ringer.ring(ticket, DIGESTS, [7])
        except OSError as exc:
            return False, f"a box cannot be opened through /proc: {exc}"
        rung = box.wait(ticket, 1.0)
        if rung is None or rung[1].tolist() != [7]:
            return False, "a ring did not read back"
        return True, "memfd box, futex waits"
