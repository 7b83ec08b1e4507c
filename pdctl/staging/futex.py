"""Futex waits and wakes on 32-bit words of memory shared between processes.

A process that waits for another one's store into shared memory should sleep in the
kernel, not spin on a core the other process needs (two cores here). A futex wait
sleeps only while the word still holds the value the caller read, so a store that
came in between is never missed; a wake after the store ends every sleeper at once.
The waits release the GIL (`ctypes.CDLL`); a wake keeps it (`ctypes.PyDLL`: one
system call of a few microseconds, never blocking, so the caller does not pay for
getting the GIL back in a busy server). Linux on x86_64 or aarch64 only:
`available()` says whether this machine has them.

What this does not know: what the words mean (`serve.tp_shm`'s sequence numbers,
`doorbell`'s announcements).
"""

from __future__ import annotations

import ctypes
import os

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_PR_SET_TIMERSLACK = 29
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_FREE = ctypes.CDLL(None, use_errno=True)  # releases the GIL: for waits
_HELD = ctypes.PyDLL(None, use_errno=True)  # keeps it: for wakes


def available() -> bool:
    """Futexes on this machine (Linux on x86_64 or aarch64)."""
    return _SYS_FUTEX is not None


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep until a wake on the int32 at `address`, `timeout_s` passed, or the word no
    longer holds `seen` (then at once); a signal may end it early too. Callers re-read
    the word and decide."""
    seconds = max(0.0, timeout_s)
    timeout = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    word, expected = ctypes.c_void_p(address), ctypes.c_int32(seen).value
    _FREE.syscall(_SYS_FUTEX, word, _FUTEX_WAIT, expected, ctypes.byref(timeout), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the int32 at `address` (after storing into it)."""
    _HELD.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 2**31 - 1, None, None, 0)


def fine_timer_slack() -> None:
    """This thread's sleeps end within about a microsecond of their timeout instead of
    Linux's default 50 (a short timed wait is then as short as asked)."""
    _FREE.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)
