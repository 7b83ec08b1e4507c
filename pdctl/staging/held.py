"""CUDA calls that keep the GIL: an event's record and query, a graph's launch, an
upload ahead of it.

In a server whose HTTP side runs on other threads, every call that releases the GIL
costs the caller getting it back: up to the switch interval each time, when another
thread was waiting for it. The mapped write's enqueue, a few such calls, measured
0.3 ms alone and 4.9 ms with one thread contending for the GIL on the H200 host
(`benchmarks/pd_write_profile.py`). The calls here take microseconds and never
block, so they go to the CUDA driver through `ctypes.PyDLL`, which keeps the GIL.
A wait that may block (`HeldEvent.synchronize` on an event not yet reached) still
releases it.

`held_event(device)` gives a `HeldEvent` where the driver is loaded and the calling
thread has a current context, else None (the caller keeps torch's event); an event
here and torch's stream handles are the driver's own (the runtime's handles are the
driver's). What this does not know: torch's bookkeeping of its graphs and streams;
it only launches what torch captured, on a stream torch made.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("pdctl.staging")

CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600


class _Driver:
    """libcuda's few entry points used here, twice: through PyDLL (GIL kept) and
    through CDLL (GIL released, for a wait)."""

    def __init__(self) -> None:
        held, free = ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1")
        p, vp, u = ctypes.POINTER, ctypes.c_void_p, ctypes.c_uint
        self.ctx_get_current = _fn(held, "cuCtxGetCurrent", [p(vp)])
        self.event_create = _fn(held, "cuEventCreate", [p(vp), u])
        self.event_destroy = _fn(held, "cuEventDestroy_v2", [vp])
        self.event_record = _fn(held, "cuEventRecord", [vp, vp])
        self.event_query = _fn(held, "cuEventQuery", [vp])
        self.event_elapsed = _fn(held, "cuEventElapsedTime", [p(ctypes.c_float), vp, vp])
        self.event_wait = _fn(free, "cuEventSynchronize", [vp])
        self.graph_launch = _fn(held, "cuGraphLaunch", [vp, vp])
        size = ctypes.c_size_t
        self.copy_to_device = _fn(held, "cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, vp, size, vp])
        self.stream_wait = _fn(held, "cuStreamWaitEvent", [vp, vp, u])

    def check(self, result: int, what: str) -> None:
        if result != CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {what} failed with error {result}")

    def has_context(self) -> bool:
        context = ctypes.c_void_p()
        return self.ctx_get_current(ctypes.byref(context)) == CUDA_SUCCESS and bool(context.value)


def _fn(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
    function = getattr(lib, name)
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


_DRIVER: _Driver | None = None
_LOADED = False


def driver() -> _Driver | None:
    """The driver's calls, or None where libcuda cannot be loaded."""
    global _DRIVER, _LOADED
    if not _LOADED:
        _LOADED = True
        try:
            _DRIVER = _Driver()
        except (OSError, AttributeError) as exc:
            log.info("staging: CUDA driver calls go through torch (%s)", exc)
    return _DRIVER


def stream_handle(stream: Any) -> int:
    """A torch CUDA stream's handle (0: the legacy default stream)."""
    return int(stream.cuda_stream)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(index: int) -> int:
    """The calling thread's current stream on CUDA device `index`, as a handle: read
    without making a torch stream object (which costs several microseconds a call on
    a slow host), where this torch offers that."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return stream_handle(torch.cuda.current_stream(index))  # cuda-only: a CUDA stream


def stream_reader(index: int) -> Callable[[], int]:
    """`current_stream_handle(index)` as a function of no argument, for a caller that
    reads it on every call (a replay): torch's own reader bound to the device where
    this torch offers it, so no Python function runs between the caller and torch."""
    if _RAW_STREAM is not None:
        return functools.partial(_RAW_STREAM, index)
    return functools.partial(current_stream_handle, index)


class HeldEvent:
    """A timing event whose record, query and elapsed time keep the GIL; the same
    calls as torch's CUDA Event (record takes a torch stream, or the current one)."""

    def __init__(self, calls: _Driver, device: torch.device, flags: int = 0) -> None:
        self._calls, self._device = calls, device
        handle = ctypes.c_void_p()
        calls.check(calls.event_create(ctypes.byref(handle), flags), "cuEventCreate")
        self.handle = handle
        # the driver's query of this event, called with no Python function in between:
        # 0 once the device passed the record, else CUDA_ERROR_NOT_READY or an error
        # (which `synchronize` raises)
        self.unpassed: Callable[[], int] = functools.partial(calls.event_query, handle)

    def record(self, stream: Any = None) -> None:
        """Recorded on `stream`: a torch stream, a stream handle (int), or the current."""
        if stream is None:
            stream = torch.cuda.current_stream(self._device)  # cuda-only: a CUDA event
        handle = stream if isinstance(stream, int) else stream_handle(stream)
        self._calls.check(self._calls.event_record(self.handle, handle), "cuEventRecord")

    def query(self) -> bool:
        result = self._calls.event_query(self.handle)
        if result == CUDA_ERROR_NOT_READY:
            return False
        self._calls.check(result, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        """Until the device passed the record (the GIL released only if it must wait)."""
        if not self.query():
            self._calls.check(self._calls.event_wait(self.handle), "cuEventSynchronize")

    def elapsed_time(self, end: HeldEvent) -> float:
        """Milliseconds from this event to `end`, both recorded and reached."""
        end.synchronize()
        milliseconds = ctypes.c_float()
        self._calls.check(
            self._calls.event_elapsed(ctypes.byref(milliseconds), self.handle, end.handle),
            "cuEventElapsedTime",
        )
        return float(milliseconds.value)

    def __del__(self) -> None:
        if self.handle.value:
            self._calls.event_destroy(self.handle)
            self.handle = ctypes.c_void_p()


def held_event(device: torch.device) -> HeldEvent | None:
    """A HeldEvent on this thread's current CUDA context, or None (use torch's)."""
    if device.type != "cuda":
        return None
    calls = driver()
    if calls is None or not calls.has_context():
        return None
    try:
        return HeldEvent(calls, device)
    except RuntimeError as exc:
        log.info("staging: %s; events go through torch", exc)
        return None


CU_EVENT_DISABLE_TIMING = 2


class HeldUpload:
    """A host-to-device copy on a stream of its own, which the launching stream waits
    for: the copy engine brings the next call's ids while the compute engine still runs
    the call before (`captured.CudaSlot`, AHEAD). Keeps the GIL like the rest."""

    def __init__(self, calls: _Driver, device: torch.device) -> None:
        self._calls = calls
        self.stream = torch.cuda.Stream(device)  # cuda-only: a CUDA stream
        self.stream_handle = stream_handle(self.stream)
        self.done = HeldEvent(calls, device, CU_EVENT_DISABLE_TIMING)

    def copy(self, target: int, source: int, nbytes: int, before: int) -> None:
        """`nbytes` from pinned host address `source` to device address `target`, on the
        upload stream; the stream with handle `before` waits for them (nothing else)."""
        calls = self._calls
        copied = calls.copy_to_device(target, source, nbytes, self.stream_handle)
        calls.check(copied, "cuMemcpyHtoDAsync")
        self.done.record(self.stream_handle)
        calls.check(calls.stream_wait(before, self.done.handle, 0), "cuStreamWaitEvent")


def held_upload(device: torch.device) -> HeldUpload | None:
    """A HeldUpload on this thread's current CUDA context, or None (no driver)."""
    calls = driver()
    if device.type != "cuda" or calls is None or not calls.has_context():
        return None
    try:
        return HeldUpload(calls, device)
    except RuntimeError as exc:
        log.info("staging: %s; ids are uploaded inside the graph", exc)
        return None


class HeldGraph:
    """A captured torch CUDA graph, launched through the driver keeping the GIL: its
    executable's handle read once (torch instantiates it when the capture ends)."""

    def __init__(self, calls: _Driver, executable: int) -> None:
        self._calls, self.executable = calls, ctypes.c_void_p(executable)

    def launch(self, stream: int) -> None:
        """On the stream with this handle (`current_stream_handle`)."""
        self._calls.check(self._calls.graph_launch(self.executable, stream), "cuGraphLaunch")


def held_graph(graph: Any) -> HeldGraph | None:
    """`graph` (a torch CUDA graph, captured) to launch through the driver, or None
    (no driver, no raw handle in this torch, no context on this thread: torch's
    `replay` then)."""
    calls = driver()
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if calls is None or raw is None or not calls.has_context():
        return None
    executable = int(raw())
    return HeldGraph(calls, executable) if executable else None


SCHEDULES = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*


def set_schedule(mode: str) -> str | None:
    """How this process's CUDA waits for the device, set on every visible device's
    primary context before torch makes it current: "spin" polls on the CPU (what
    "auto" picks with more cores than GPUs), "yield" polls and yields the core,
    "blocking" sleeps until the device signals. Returns why it could not be set
    (no driver, a context already active), or None."""
    if mode not in SCHEDULES:
        return f"{mode!r} is not one of {', '.join(SCHEDULES)}"
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
    except OSError as exc:
        return f"no CUDA driver ({exc})"
    count = ctypes.c_int()
    if lib.cuInit(0) != CUDA_SUCCESS or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return "the CUDA driver did not initialise"
    for ordinal in range(count.value):
        device = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(device), ordinal) != CUDA_SUCCESS:
            return f"device {ordinal} could not be opened"
        result = lib.cuDevicePrimaryCtxSetFlags_v2(device, ctypes.c_uint(SCHEDULES[mode]))
        if result != CUDA_SUCCESS:
            return f"device {ordinal}: cuDevicePrimaryCtxSetFlags failed with error {result}"
    return None
