"""Device helpers: the only place in pdctl that resolves a device module.

Everything device-specific goes through `torch.get_device_module(device)`, so the
staging path runs unchanged on CPU, CUDA, XPU, NPU or any backend torch knows.
CPU is a first-class device: its streams and events are correct no-ops (work on the
CPU is synchronous, so an event is complete as soon as it is recorded).

Call these through the module (`device.synchronize(...)`), not through names
imported from it: tests count calls by patching this module.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

DeviceLike = torch.device | str


class HostEvent:
    """An event on the CPU: complete when recorded (the clock read then, for timing)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this record to `end`'s, as device events give them."""
        if self.at is None or end.at is None:
            raise RuntimeError("both events must be recorded before their elapsed time")
        return (end.at - self.at) * 1e3

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostStream:
    """A stream on the CPU: work runs synchronously, so every wait is satisfied."""

    device = torch.device("cpu")

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> HostEvent:
        return event if isinstance(event, HostEvent) else HostEvent()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_HOST_STREAM = HostStream()


def as_device(device: DeviceLike) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def get_device_module(device: DeviceLike) -> ModuleType:
    """torch.cuda, torch.xpu, torch.npu, ... for the device's type."""
    return torch.get_device_module(as_device(device).type)


def create_device_event(device: DeviceLike, *, timing: bool = False) -> Any:
    """An event of the device's own kind (`timing`: one whose elapsed time can be read)."""
    device = as_device(device)
    if device.type == "cpu":
        return HostEvent()
    module = get_device_module(device)
    event_class = getattr(module, "Event", None)
    if event_class is not None:
        return event_class(enable_timing=True) if timing else event_class()
    return torch.Event(device.type, enable_timing=timing)


def create_device_stream(device: DeviceLike) -> Any:
    device = as_device(device)
    if device.type == "cpu":
        return _HOST_STREAM
    return get_device_module(device).Stream(device=device)


def current_device_stream(device: DeviceLike) -> Any:
    """The calling thread's current stream on `device` (thread-local on accelerators)."""
    device = as_device(device)
    if device.type == "cpu":
        return _HOST_STREAM
    return get_device_module(device).current_stream(device)


@contextlib.contextmanager
def device_stream_context(stream: Any) -> Iterator[None]:
    """Make `stream` current for the block, on whatever device it belongs to."""
    if stream is None or isinstance(stream, HostStream):
        yield
        return
    with get_device_module(stream.device).stream(stream):
        yield


def device_context(device: DeviceLike) -> contextlib.AbstractContextManager[Any]:
    """Make `device` the calling thread's current device for the block (CPU: no-op).

    The current device is per thread: a worker thread starts on device 0 whatever
    device its tensors live on, and launchers that read it (Triton) need this.
    """
    device = as_device(device)
    if device.type == "cpu":
        return contextlib.nullcontext()
    return get_device_module(device).device(device)


def stream_wait_event(stream: Any, event: Any) -> None:
    """Order later work on `stream` after `event` (not after the whole recording stream)."""
    stream.wait_event(event)


def synchronize_stream(stream: Any) -> None:
    """Block the calling thread until `stream` has drained."""
    stream.synchronize()


def synchronize(device: DeviceLike) -> None:
    """Block until all work on `device` finished; a no-op on the CPU only."""
    device = as_device(device)
    if device.type != "cpu":
        get_device_module(device).synchronize(device)


def resolve_device(device_type: str, gpu_id: int | None = None) -> torch.device:
    """`device_type` ("xpu" or "xpu:3") plus `gpu_id` -> one torch.device.

    An index inside `device_type` wins over `gpu_id`, with a warning when they
    differ, so a caller passing "xpu:3" can never allocate on another device.
    """
    if not isinstance(device_type, str) or not device_type:
        raise ValueError(f"device_type must be a device name such as 'cuda', got {device_type!r}")
    try:
        parsed = torch.device(device_type)
    except RuntimeError:
        raise ValueError(
            f"device type {device_type!r} is not known to this torch build "
            "(a backend such as torch_npu registers it when imported)"
        ) from None
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.index is not None:
        if gpu_id is not None and gpu_id != parsed.index:
            warnings.warn(
                f"device_type {device_type!r} names index {parsed.index} but gpu_id is {gpu_id}; "
                f"using {parsed}",
                stacklevel=2,
            )
        return parsed
    return torch.device(parsed.type, gpu_id if gpu_id is not None else 0)
