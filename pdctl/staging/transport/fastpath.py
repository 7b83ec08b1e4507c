"""Same-host fast path: write straight into a peer process's memory.

`process_vm_writev(2)` copies from this process into another one without a
socket or an intermediate buffer: one memcpy at close to memory bandwidth. It is
allowed when this process may ptrace the peer (same user and no Yama
restriction, or CAP_SYS_PTRACE). pdctl never assumes it: a connection probes it by
writing a random token into a cell the peer reads back, and falls back to TCP when
the kernel refuses.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

IOV_MAX = 1024


class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.process_vm_writev
    except (OSError, AttributeError):
        return None
    iov, count = ctypes.POINTER(IOVec), ctypes.c_ulong  # (pid, local, n, remote, n, flags)
    function.argtypes = [ctypes.c_int, iov, count, iov, count, ctypes.c_ulong]
    function.restype = ctypes.c_ssize_t
    return libc


_LIBC = _libc()


def available() -> bool:
    return _LIBC is not None


def host_id() -> str:
    """Same value in two processes iff they share a kernel boot and a pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"{socket.gethostname()}:unknown"
    return f"{boot}:{namespace}"


def _batches(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
) -> Iterator[tuple[int, int, int]]:
    """(start, stop, total bytes) slices of at most IOV_MAX descriptors."""
    for start in range(0, len(src), IOV_MAX):
        stop = min(start + IOV_MAX, len(src))
        yield start, stop, int(lengths[start:stop].sum())


PARALLEL_MIN_BYTES = 16 << 20  # below this, one thread is faster than two
WORKERS = min(os.cpu_count() or 1, 4)
_EXECUTOR: list[ThreadPoolExecutor] = []
_EXECUTOR_LOCK = threading.Lock()


def _executor(workers: int) -> ThreadPoolExecutor:
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(workers, thread_name_prefix="pdctl-fastpath"))
        return _EXECUTOR[0]


def _split(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, parts: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Cut the ranges into `parts` groups of about equal bytes (large ranges are cut too)."""
    total = int(lengths.sum())
    share = -(-total // parts)
    groups: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(parts)]
    group, room = 0, share
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        while n > 0:
            take = min(n, room) if group < parts - 1 else n
            groups[group][0].append(s)
            groups[group][1].append(d)
            groups[group][2].append(take)
            s, d, n, room = s + take, d + take, n - take, room - take
            if room == 0 and group < parts - 1:
                group, room = group + 1, share
    return [
        (np.array(a, dtype=np.uint64), np.array(b, dtype=np.uint64), np.array(c, dtype=np.uint64))
        for a, b, c in groups
        if c
    ]


def write(pid: int, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
    """Copy each src range of this process to the dst range of process `pid`.

    Large writes are split over the CPU's cores (the copies release the GIL).
    Raises OSError (errno set: ESRCH when the peer died, EPERM when not allowed).
    """
    workers = WORKERS
    if workers > 1 and int(lengths.sum()) >= PARALLEL_MIN_BYTES:
        parts = _split(src, dst, lengths, workers)
        futures = [_executor(workers).submit(_write_serial, pid, *part) for part in parts[1:]]
        _write_serial(pid, *parts[0])
        for future in futures:
            future.result()
        return
    _write_serial(pid, src, dst, lengths)


def _wrote(written: int) -> int:
    """process_vm_writev's result as bytes written, or the OSError it stands for."""
    if written < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    if written == 0:
        raise OSError(5, "process_vm_writev wrote nothing")
    return written


def _write_one(pid: int, src: int, dst: int, length: int) -> None:
    """One range: no vectors to build (small writes are bound by this host work)."""
    assert _LIBC is not None
    done = 0
    while done < length:
        local = IOVec(src + done, length - done)
        remote = IOVec(dst + done, length - done)
        done += _wrote(
            _LIBC.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        )


def _write_serial(pid: int, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
    if _LIBC is None:
        raise OSError(38, "process_vm_writev is not available")
    if len(src) == 1:
        _write_one(pid, int(src[0]), int(dst[0]), int(lengths[0]))
        return
    for start, stop, total in _batches(src, dst, lengths):
        local = _vectors(src[start:stop], lengths[start:stop])
        remote = _vectors(dst[start:stop], lengths[start:stop])
        count = stop - start
        done = 0
        while done < total:
            written = _wrote(
                _LIBC.process_vm_writev(pid, _pointer(local), count, _pointer(remote), count, 0)
            )
            done += written
            if done < total:  # partial: move both vectors past what was written
                _advance(local, written)
                _advance(remote, written)


IOVEC_DTYPE = np.dtype([("base", np.uint64), ("length", np.uint64)])


def _vectors(addresses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """struct iovec[] built by numpy, no Python loop over descriptors."""
    vectors = np.empty(len(addresses), dtype=IOVEC_DTYPE)
    vectors["base"] = addresses
    vectors["length"] = lengths
    return vectors


def _pointer(vectors: np.ndarray) -> ctypes._Pointer[IOVec]:
    return ctypes.cast(vectors.ctypes.data, ctypes.POINTER(IOVec))


def _advance(vectors: np.ndarray, written: int) -> None:
    consumed = np.minimum(np.cumsum(vectors["length"]), np.uint64(written))
    taken = np.diff(consumed, prepend=np.uint64(0))
    vectors["base"] += taken
    vectors["length"] -= taken


def probe() -> tuple[bool, str]:
    """Can this process write into another process of the same user? (forks a child)"""
    if _LIBC is None:
        return False, "process_vm_writev is not available in this libc"
    token = os.urandom(16)
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: expose a cell, wait, report whether the token landed
        cell = ctypes.create_string_buffer(16)
        os.write(from_child, ctypes.addressof(cell).to_bytes(8, "little"))
        expected = os.read(to_child, 16)
        os._exit(0 if cell.raw == expected else 1)
    try:
        address = int.from_bytes(os.read(to_parent, 8), "little")
        source = ctypes.create_string_buffer(token, 16)
        one = np.ones(1, dtype=np.uint64)
        try:
            _write_serial(pid, one * ctypes.addressof(source), one * address, one * 16)
            reason = "direct writes into same-host peers work"
        except OSError as exc:
            reason = (
                f"the kernel refused process_vm_writev ({exc.strerror}); same-host peers use TCP"
            )
        os.write(from_parent, token)
        _, status = os.waitpid(pid, 0)
        ok = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        if not ok and reason.startswith("direct"):
            reason = "the probe token did not arrive in the child; same-host peers use TCP"
        return ok, reason
    finally:
        for fd in (to_parent, from_child, to_child, from_parent):
            os.close(fd)
