"""A captured staging call's replay in one call into C: the upload ahead, the graph's
launch and the events around them (`held_replay.c`), keeping the GIL as `held` does.

A replay (`kernels.captured.CudaSlot`) is five CUDA driver calls: the slot's ids
copied to the device on an upload stream, an event recorded behind the copy, the
launching stream made to wait for it, the graph launched, the slot's event recorded.
Made one by one from Python through ctypes, each pays its argument conversions and a
status check in Python: 20-27 us a call on the H200's host, where the device needs
about 62 us for a 28 x 2 x 128 scatter and the host 75-85 us to issue one
(`benchmarks/staging_e2e_profile.py`). Here the five run in one ctypes call to a function
built from `held_replay.c` with the host's compiler, as the CPU staging copy is
(`kernels.native.build`); the entry points are libcuda's, handed over as addresses.

`HeldReplay.replay_checked` does the replay's host work first in the same call: the
slot's event queried, the call's page ids checked and written into the slot (the C
page check of `kernels.native`, the same code the Python path calls). What it cannot
do there, it says (`SLOT_BUSY`, `FEW_STAMPS`, `IDS_REFUSED`) and the caller does it.

`held_replay(...)` gives a `HeldReplay` where the library builds and the driver is
loaded, else None (the caller makes the calls one by one, as it does with the
settings' `replay_in_c` off).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdctl.staging.held import HeldEvent, HeldGraph, HeldUpload, driver
from pdctl.staging.kernels.native import STAMPS, check_function

log = logging.getLogger("pdctl.staging")

SOURCE = Path(__file__).with_name("held_replay.c")
STEPS = (
    "cuMemcpyHtoDAsync",
    "cuEventRecord (upload)",
    "cuStreamWaitEvent",
    "cuGraphLaunch",
    "cuEventRecord",
    "cuEventQuery",
)
# what pdctl_checked_replay leaves to its caller (held_replay.c), besides REPLAYED = 0
SLOT_BUSY, FEW_STAMPS, IDS_REFUSED = 1, 2, 3


class ReplayArgs(ctypes.Structure):
    """`replay_t` of held_replay.c: the driver's entry points, then one slot's handles."""

    _fields_ = [
        ("copy", ctypes.c_void_p),
        ("record", ctypes.c_void_p),
        ("wait", ctypes.c_void_p),
        ("launch", ctypes.c_void_p),
        ("device_ids", ctypes.c_uint64),
        ("host_ids", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
        ("upload_stream", ctypes.c_void_p),
        ("uploaded", ctypes.c_void_p),
        ("graph", ctypes.c_void_p),
        ("done", ctypes.c_void_p),
        ("query", ctypes.c_void_p),
        ("check", ctypes.c_void_p),
        ("count", ctypes.c_int64),
    ]


@functools.cache
def replay_library() -> tuple[Any, str]:
    """(the built held_replay.c, its functions called keeping the GIL, or None; why not)."""
    from pdctl.staging.kernels.native import build

    try:
        library = ctypes.PyDLL(str(build(SOURCE, "staging-replay")))
    except OSError as exc:
        return None, str(exc)
    for function in (library.pdctl_replay, library.pdctl_checked_replay):
        function.restype = ctypes.c_int
    library.pdctl_replay.argtypes = [ctypes.c_void_p] * 2
    vp = ctypes.c_void_p
    # the slot's args, the ids, the pool's pages, the thread's stamps, the stream
    library.pdctl_checked_replay.argtypes = [vp, vp, ctypes.c_int64, vp, vp]
    return library, "built"


def address(function: Any) -> int:
    """A ctypes function's entry point, as an address."""
    return int(ctypes.cast(function, ctypes.c_void_p).value or 0)


def raise_for(status: int) -> None:
    """Nothing for 0; else the failing step and the driver's error, as `held` says them."""
    if status:
        step, error = divmod(status, 1000)
        raise RuntimeError(f"CUDA driver: {STEPS[step - 1]} failed with error {error}")


class HeldReplay:
    """One slot's replay (upload ahead, launch, events) in one call; the handles it
    names stay alive as long as it does. `checks`: whether `replay_checked` can run
    (the page check was built)."""

    def __init__(self, library: Any, args: ReplayArgs, keep: tuple[Any, ...]) -> None:
        self._function, self._args, self._keep = library.pdctl_replay, args, keep
        self._checked = library.pdctl_checked_replay
        self._address = ctypes.addressof(args)
        self.checks = bool(args.check)

    def replay(self, stream: int) -> None:
        """On the stream with this handle (`held.current_stream_handle`)."""
        raise_for(self._function(self._address, stream))

    def replay_checked(
        self, ids: int, num_pages: int, stream: int, wait: Callable[[], object]
    ) -> bool:
        """The replay with the slot's wait and the page check before it, in the same
        call (`pdctl_checked_replay`): the slot's count of int64 ids at address `ids`,
        checked against a pool of `num_pages` and written to the slot's pinned ids.
        `wait`: until the device passed the slot's last replay, the GIL given up. False
        when an id is refused: nothing launched, the caller's own check names it."""
        stamps = STAMPS
        status = self._checked(self._address, ids, num_pages, stamps.ref, stream)
        while status:
            if status == SLOT_BUSY:
                wait()
            elif status == FEW_STAMPS:
                stamps.grow(num_pages)
            elif status == IDS_REFUSED:
                return False
            else:
                raise_for(status)
            status = self._checked(self._address, ids, num_pages, stamps.ref, stream)
        return True


def held_replay(
    upload: HeldUpload,
    graph: HeldGraph,
    done: HeldEvent,
    ids: tuple[int, int, int],  # (device address, pinned host address, bytes)
) -> HeldReplay | None:
    """The slot's replay in one C call, or None (no driver, no compiler)."""
    calls = driver()
    if calls is None:
        return None
    library, why = replay_library()
    if library is None:
        log.info("staging: a replay's driver calls go one by one (%s)", why)
        return None
    steps = (calls.copy_to_device, calls.event_record, calls.stream_wait, calls.graph_launch)
    handles = (upload.stream_handle, upload.done.handle.value, graph.executable.value)
    checks = (address(calls.event_query), check_function() or 0, ids[2] // 8)  # 8-byte ids
    # `replay_t`'s fields in order: the steps' entry points, the ids (device, pinned,
    # bytes), the slot's handles and event, then what the checked replay adds
    args = ReplayArgs(*map(address, steps), *ids, *handles, done.handle.value, *checks)
    return HeldReplay(library, args, (upload, graph, done))
