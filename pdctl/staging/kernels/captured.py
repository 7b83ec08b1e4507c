"""Checked staging calls replayed as CUDA graphs: a repeated call's host work is a
lookup, the page check (which writes the ids into pinned memory as it reads them) and
one graph launch.

A checked gather or scatter does tens of microseconds of host work (views, the ids'
upload, the kernel's launch), as long as the device takes to copy a hundred
megabytes; where the host is slow, that work, not the copy, sets the rate. A call
that comes back the same (the same KV lists, the same staging memory, as many page
ids, the same page size, heads and backend) is captured, on its SIGHTS-th sight, as
a graph of the kernels reading the slot's device ids, which a copy on a stream of the
slot's own brings from its pinned ids just before, ahead of the graph's stream (the
copy engine works while the call before still runs; `held.HeldUpload`). Where that
cannot be (no driver, or the settings' `upload_ahead` off) the graph starts with the
upload itself (a kernel reading the host memory, `kernels.upload`; a copy with the
settings' `upload_kernel` off or where the kernel cannot run). A
shape dropped (the least recently used, or its key named other tensors) first waits
for its replays.
A replay reads the ids the host wrote to the slot just before. The upload ahead, the
launch and the events around them are one call into C where it builds
(`held_replay`; the settings' `replay_in_c`), five driver calls Python otherwise makes
one by one. The switches are a `StagingSettings` handed to `CapturedCalls`
(`staging/settings.py`), its `graphs` whether anything is captured. A call whose
ids are a replay's usual ones (`pages.usual_ids`) goes further (`replay_usual`): the
slot's wait and the page check are in that C call too, so a replay is a lookup and
one call; the ids it refuses take the path below, which names what is wrong.

Each call shape keeps a ring of SLOTS graphs, each with its own pinned ids and
device ids, and an event recorded behind each replay: a slot is written again only
once the device passed its last replay, so the host never overwrites ids that a
queued replay has yet to read. Ids are range- and duplicate-checked on the host on
every call, as the eager path checks them. Ids already on the device, other
devices than CUDA, and a shape whose capture failed go the eager way. The caches
are per thread (a graph is replayed by the thread that captured it); each entry
holds the KV lists it names (their identity is checked on every call, and the
graph holds their addresses). The staging memory is named by its address, size,
dtype and layout, all a replay's effect depends on.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np
import torch

from pdctl.staging import held, held_replay
from pdctl.staging.kernels.base import keeping
from pdctl.staging.settings import StagingSettings

log = logging.getLogger("pdctl.staging")

SIGHTS = 3  # eager calls of a shape before the next one captures it
SLOTS = 4  # graphs per shape, replayed in turn
MAX_SHAPES = 32  # per thread; the least recently used shape is dropped

T = TypeVar("T")
MISSED: Any = object()  # `replay_usual` could not replay: the caller arms the call
T_co = TypeVar("T_co", covariant=True)
Eager = Callable[[Any], Any]  # the checked call on these ids (host or device) -> its value
# the call's host ids, checked (raising as the eager call would), as a CPU tensor; with
# a slot's pinned ids given, written there in the same pass (and those returned)
HostIds = Callable[[torch.Tensor | None], torch.Tensor]
Named = Sequence[Sequence[torch.Tensor]]  # the tensor lists a call reads and writes


class Slot(Protocol[T_co]):
    ids: torch.Tensor  # the replay's ids (int64, CPU), written by the host before `replay`
    armed: bool  # ids written for a replay not yet launched (`CapturedCalls.arm`)

    @property
    def value(self) -> T_co:
        """What a replay gives (the captured call's value)."""

    def replay(self, given: Any = None) -> T_co:
        """The graph launched; what it gives, made from `given` where the slot makes it
        (`CapturedCalls.arm`'s `given`: a write's words), else `value`."""

    def wait(self) -> None:
        """Until the device passed this slot's last replay (its ids were read)."""

    def replay_checked(self, address: int, num_pages: int) -> bool:
        """The replay with the slot's count of int64 ids at `address` checked against a
        pool of `num_pages` and written to the slot, after its wait, in one go; False
        where the slot cannot or an id is refused (nothing launched: the caller's path
        through `ids` says why)."""


# (device, number of ids, the eager call, the value its eager call gave, the switches)
# -> the slots
Capture = Callable[[torch.device, int, Eager, Any, StagingSettings], list[Slot[Any]]]


@dataclass
class _Shape:
    named: tuple[tuple[torch.Tensor, ...], ...]  # held: no id below can be reused meanwhile
    sights: int = 1
    slots: list[Slot[Any]] = field(default_factory=list)
    next: int = 0
    failed: bool = False

    def retire(self) -> None:
        """Before this shape is dropped: until the device passed every replay of its
        slots (their graphs, ids and memory are freed with them)."""
        for slot in self.slots:
            slot.wait()

    def names(self, named: Named) -> bool:
        """The same tensors, by identity (a graph holds their addresses): a C-speed
        walk of each list, nothing allocated."""
        if len(named) != len(self.named):
            return False
        for kept, given in zip(self.named, named, strict=True):
            if len(kept) != len(given) or not all(map(operator.is_, kept, given)):
                return False
        return True


class CudaSlot:
    """One captured graph: its pinned ids, the device ids it uploads them to, and the
    event behind its last replay. A replay gives the value the captured call gave
    (`body`; for a gather or scatter its byte count, the same on every replay). The
    upload ahead (through the driver only, `held`), the upload kernel inside the graph
    where there is none, and the replay's one C call each where `settings` has it on.
    A slot whose value differs by call (a write's digests, `write_slots`) says so
    (`hands_out`) and makes it in `hand_out`."""

    hands_out: ClassVar[bool] = False

    def __init__(
        self,
        device: torch.device,
        num_ids: int,
        eager: Eager,
        pool: Any,
        settings: StagingSettings,
    ) -> None:
        self.ids = torch.empty(num_ids, dtype=torch.int64, pin_memory=True)
        self.device_ids = torch.empty(num_ids, dtype=torch.int64, device=device)
        self.device = device
        current = torch.cuda.current_device  # cuda-only: graphs are CUDA's
        self.index = device.index if device.index is not None else current()
        self.current_stream = held.stream_reader(self.index)  # its handle, read per replay
        self.armed = False
        fallback = torch.cuda.Event  # cuda-only: graphs are CUDA's
        self.done: Any = held.held_event(device) or fallback()
        # nonzero while the device has yet to pass the last replay: the driver's query
        # itself where the event is the driver's (no Python function runs for it); none
        # holds the slot, which must go when its last reference does (a slot left to the
        # garbage collector may be freed in the middle of another shape's capture)
        done = self.done
        self.unpassed: Callable[[], object] = getattr(done, "unpassed", None) or (
            lambda: not done.query()
        )
        self.used = False
        # what the last replay handed out that reads this slot's host memory until its
        # `result()` was read (`ready`): read before the slot is written again
        self.last: Any = None
        self.graph = torch.cuda.CUDAGraph()  # cuda-only: graphs are CUDA's
        stream = torch.cuda.Stream(device)  # cuda-only: graphs are CUDA's
        self.ahead = held.held_upload(device) if settings.upload_ahead else None
        if self.ahead is not None:  # `device_ids` may be memory the caller's stream still
            # reads (an eager call's freed temporaries): the first copy goes after that work
            self.ahead.stream.wait_stream(torch.cuda.current_stream(device))  # cuda-only: too
        upload = None
        if self.ahead is None:
            upload = _uploader(self.ids, self.device_ids, kernel=settings.upload_kernel)
        capturing = torch.cuda.graph(  # cuda-only: graphs are CUDA's
            self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"
        )
        with keeping() as self.kept, capturing:  # the pointer tables it reads stay alive
            if upload is not None:
                upload()
            self.value = self.body(eager, self.device_ids)
        launcher = held.held_graph(self.graph)
        self.launcher = launcher if isinstance(self.done, held.HeldEvent) else None
        if self.launcher is None and self.ahead is not None:  # cannot happen with a driver
            raise RuntimeError("an upload ahead needs the graph launched through the driver")
        self.upload_args = (self.device_ids.data_ptr(), self.ids.data_ptr(), self.ids.nbytes)
        # the upload, launch and events of a replay in one call into C, where it builds
        self.one_call = None
        if settings.replay_in_c and self.launcher is not None and self.ahead is not None:
            assert isinstance(self.done, held.HeldEvent)
            self.one_call = held_replay.held_replay(
                self.ahead, self.launcher, self.done, self.upload_args
            )

    def body(self, eager: Eager, device_ids: torch.Tensor) -> Any:
        """What the graph holds, run once under capture: the call on the device ids."""
        return eager(device_ids)

    def replay(self, given: Any = None) -> Any:
        """The graph launched on the current stream, and the event behind it recorded:
        through the driver with the GIL kept where it is at hand (`staging.held`), the
        stream read as a handle. Gives `value`, or what `hand_out` makes of `given`."""
        if self.one_call is not None:
            self.one_call.replay(self.current_stream())
        elif self.launcher is not None:
            handle = self.current_stream()
            if self.ahead is not None:  # the ids, by the copy engine, before the graph
                self.ahead.copy(*self.upload_args, handle)
            self.launcher.launch(handle)
            self.done.record(handle)
        else:
            self.graph.replay()
            self.done.record(torch.cuda.current_stream(self.device))  # cuda-only: graphs
        self.used = True
        return self.hand_out(given) if self.hands_out else self.value

    def hand_out(self, given: Any) -> Any:
        """What a replay gives where `hands_out`: made from the `given` of its arm."""
        return self.value

    def wait(self) -> None:
        if self.last is not None and self.last.ready is None:
            self.last.result()  # read before this slot's next replay overwrites it
        if self.used and self.unpassed():
            self.done.synchronize()

    def replay_checked(self, address: int, num_pages: int) -> bool:
        one_call = self.one_call
        if one_call is None or not one_call.checks:
            return False
        stream = self.current_stream()
        if not one_call.replay_checked(address, num_pages, stream, self.done.synchronize):
            return False
        self.used = True
        return True


def _uploader(pinned: torch.Tensor, target: torch.Tensor, kernel: bool) -> Callable[[], object]:
    """What brings a slot's ids to the device inside its graph: with `kernel` the upload
    kernel (`kernels.upload`, compiled and run once here before the capture), or a copy
    without or where it cannot run.

    The run before the capture is on the caller's stream, behind the eager call that may
    still be running there: `target` was just allocated on that stream, possibly in
    memory the eager call's temporaries freed while its kernels still read them. Run on
    a side stream it could overwrite them under the running call, which would then read
    garbage ids: illegal-address faults in 2 of 9 `pdctl bench staging` runs on an H200
    with the kernel on that way, none in 20 on the caller's stream."""
    if not kernel:
        return lambda: target.copy_(pinned, non_blocking=True)
    try:
        from pdctl.staging.kernels.upload import upload

        upload(pinned, target)
        return lambda: upload(pinned, target)
    except Exception as exc:  # no Triton, or a device it cannot read host memory from
        log.info("staging: a captured call uploads its ids by a copy (%s)", exc)
        return lambda: target.copy_(pinned, non_blocking=True)


def checked_ids(ids: np.ndarray, into: torch.Tensor | None) -> torch.Tensor:
    """`HostIds` for ids checked when they were made (a write's tables): as they are,
    or copied into a slot's pinned ids."""
    if into is None:
        return torch.from_numpy(ids)
    into.numpy()[:] = ids
    return into


def capture_cuda(
    device: torch.device, num_ids: int, eager: Eager, first: Any, settings: StagingSettings
) -> list[Slot[Any]]:
    return capture_slots(device, lambda pool: CudaSlot(device, num_ids, eager, pool, settings))


def capture_slots(device: torch.device, slot: Callable[[Any], Slot[Any]]) -> list[Slot[Any]]:
    """SLOTS graphs of one shape, `slot(pool)` each, sharing one memory pool."""
    with torch.cuda.device(device):  # cuda-only: graphs are CUDA's
        pool = torch.cuda.graph_pool_handle()  # cuda-only: graphs are CUDA's
        return [slot(pool) for _ in range(SLOTS)]


class CapturedCalls(Generic[T]):
    """`arm(key, ...)()`: the checked call `eager`, replayed from a graph once its shape
    came back SIGHTS times (see the module's docstring), as `settings` says (its
    `graphs` off, the callers go the eager way without arming: `enabled`)."""

    def __init__(
        self,
        capture: Capture = capture_cuda,
        sights: int = SIGHTS,
        *,
        settings: StagingSettings | None = None,
    ) -> None:
        self._capture = capture
        self._sights = sights
        self.settings = settings if settings is not None else StagingSettings()
        self._local = threading.local()
        self.captures = 0  # shapes captured (all threads)
        self.replays = 0

    def configured(self, settings: StagingSettings) -> CapturedCalls[T]:
        """A fresh cache of the same capture with these switches (for a benchmark's
        side-by-side: nothing captured before is kept)."""
        return CapturedCalls(self._capture, self._sights, settings=settings)

    @property
    def enabled(self) -> bool:
        """Whether calls are captured at all (the settings' `graphs`): the caller checks
        before it arms, and goes the eager way without."""
        return self.settings.graphs

    def _shapes(self) -> OrderedDict[tuple[Any, ...], _Shape]:
        shapes = getattr(self._local, "shapes", None)
        if shapes is None:
            shapes = self._local.shapes = OrderedDict()
        return shapes

    def arm(
        self,
        key: tuple[Any, ...],
        named: Named,
        device: torch.device,
        host_ids: HostIds,
        eager: Callable[[Any], T],
        ids: Any,
        ahead: Any = None,
        given: Any = None,
    ) -> Callable[[], T]:
        """`eager(ids)` or its replay, armed: the host work now, the launch by the
        function returned (a replay, or the eager call), at once or later, on any
        thread (the caller's current stream then). `named`: the tensor lists the call
        reads and writes (a shape replays only with these very tensors); `host_ids`
        checks the ids and writes them into the replay's slot (`HostIds`). A
        replay's slot is armed until launched: a shape whose next slot is still armed
        goes the eager way for that call.

        `ahead`: what the capture needs in place of the eager call's value; given, a
        shape due for capture is captured here (capturing runs nothing on the device)
        and its first replay launched later, so the launch never pays for a capture.
        `given`: what a replay's slot makes its value from (`Slot.replay`; the eager
        call knows it already)."""
        shapes = self._shapes()
        shape = shapes.get(key)
        if shape is None or not shape.names(named):
            if shape is not None:
                shape.retire()
            shapes[key] = _Shape(tuple(tuple(tensors) for tensors in named))
            if len(shapes) > MAX_SHAPES:
                shapes.popitem(last=False)[1].retire()
            return lambda: eager(ids)  # checks every argument
        shapes.move_to_end(key)
        if shape.failed or shape.sights < self._sights:
            shape.sights += 1
            return lambda: eager(ids)
        if not shape.slots:
            checked = host_ids(None)
            if ahead is None:
                return lambda: self._first(shape, checked, eager, device)
            if not self._capture_shape(shape, device, len(checked), eager, ahead):
                return lambda: eager(checked)
        slot = shape.slots[shape.next]
        if slot.armed:
            return lambda: eager(ids)  # checks the ids itself
        shape.next = (shape.next + 1) % len(shape.slots)
        slot.wait()  # the device read this slot's ids for its last replay
        host_ids(slot.ids)  # checked, and written to the slot in one pass
        slot.armed = True

        def replay() -> T:
            slot.armed = False
            replayed: T = slot.replay(given)
            self.replays += 1
            return replayed

        return replay

    def replay_usual(self, key: tuple[Any, ...], named: Named, address: int, num_pages: int) -> T:
        """The replay of a captured shape's next slot with the ids at `address` (as many
        as the shape's, int64; a pool of `num_pages`) checked and written in the same
        C call as the launch (`Slot.replay_checked`); MISSED where that cannot be: not
        yet captured, other tensors, the slot armed, an id refused (`arm` then)."""
        shapes = self._shapes()
        shape = shapes.get(key)
        if shape is None or not shape.slots or not shape.names(named):
            return MISSED
        slot = shape.slots[shape.next]
        if slot.armed or not slot.replay_checked(address, num_pages):
            return MISSED
        shape.next = (shape.next + 1) % len(shape.slots)
        shapes.move_to_end(key)
        self.replays += 1
        return slot.value

    def _first(
        self, shape: _Shape, ids: torch.Tensor, eager: Callable[[Any], T], device: torch.device
    ) -> T:
        """This call eagerly, then the shape's capture (which runs nothing)."""
        value = eager(ids)
        self._capture_shape(shape, device, len(ids), eager, value)
        return value

    def _capture_shape(
        self, shape: _Shape, device: torch.device, num_ids: int, eager: Eager, first: Any
    ) -> bool:
        try:
            shape.slots = self._capture(device, num_ids, eager, first, self.settings)
            self.captures += 1
            return True
        except Exception as exc:  # the shape goes the eager way from now on
            shape.failed = True
            log.warning("staging: a call shape could not be captured as a graph: %s", exc)
            return False
