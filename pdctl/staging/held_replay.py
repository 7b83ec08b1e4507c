"""A captured staging call's replay in one call into C: the upload ahead, the graph's
launch and the events around them (`held_replay.c`), keeping the GIL as `held` does.

A replay (`kernels.captured.CudaSlot`) is five CUDA driver calls: the slot's ids
copied to the device on an upload stream, an event recorded behind the copy, the
launching stream made to wait for it, the graph launched, the slot's event recorded.
Made one by one from Python through ctypes, each pays its argument conversions and a
status check in Python: 20-27 us a call on the H200's host, where the device needs
about 62 us for a 28 x 2 x 128 scatter and the host 75-85 us to issue one
(docs/benchmarks.md, session 17). Here the five run in one ctypes call to a function
built from `held_replay.c` with the host's compiler, as the CPU staging copy is
(`kernels.native.build`); the entry points are libcuda's, handed over as addresses.

`held_replay(...)` gives a `HeldReplay` where the library builds and the driver is
loaded, else None (the caller makes the calls one by one);
PDCTL_STAGING_REPLAY_IN_C=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Any

from pdctl.staging.held import HeldEvent, HeldGraph, HeldUpload, driver

log = logging.getLogger("pdctl.staging")

SOURCE = Path(__file__).with_name("held_replay.c")
ENABLED = os.environ.get("PDCTL_STAGING_REPLAY_IN_C", "1") != "0"
STEPS = ("cuMemcpyHtoDAsync", "cuEventRecord (upload)", "cuStreamWaitEvent", "cuGraphLaunch",
         "cuEventRecord")  # fmt: skip


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
    ]


@functools.cache
def replay_function() -> tuple[Any, str]:
    """(`pdctl_replay`, called keeping the GIL, or None; why not)."""
    from pdctl.staging.kernels.native import build

    try:
        library = ctypes.PyDLL(str(build(SOURCE, "staging-replay")))
    except OSError as exc:
        return None, str(exc)
    function = library.pdctl_replay
    function.argtypes = [ctypes.POINTER(ReplayArgs), ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function, "built"


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
    names stay alive as long as it does."""

    def __init__(self, function: Any, args: ReplayArgs, keep: tuple[Any, ...]) -> None:
        self._function, self._args, self._keep = function, args, keep
        self._pointer = ctypes.pointer(args)

    def replay(self, stream: int) -> None:
        """On the stream with this handle (`held.current_stream_handle`)."""
        raise_for(self._function(self._pointer, stream))


def held_replay(
    upload: HeldUpload,
    graph: HeldGraph,
    done: HeldEvent,
    ids: tuple[int, int, int],  # (device address, pinned host address, bytes)
) -> HeldReplay | None:
    """The slot's replay in one C call, or None (off, no driver, no compiler)."""
    calls = driver()
    if not ENABLED or calls is None:
        return None
    function, why = replay_function()
    if function is None:
        log.info("staging: a replay's driver calls go one by one (%s)", why)
        return None
    device_ids, host_ids, nbytes = ids
    args = ReplayArgs(
        address(calls.copy_to_device), address(calls.event_record), address(calls.stream_wait),
        address(calls.graph_launch), device_ids, host_ids, nbytes, upload.stream_handle,
        upload.done.handle.value, graph.executable.value, done.handle.value,
    )  # fmt: skip
    return HeldReplay(function, args, (upload, graph, done))
