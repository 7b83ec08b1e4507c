"""CUDA calls that keep the GIL (`staging.held`): where there is no driver they step
aside for torch's; on a GPU their events time and order work as torch's do, and a
graph launched through the driver runs what torch captured."""

from __future__ import annotations

import ctypes.util
import sys
import threading
import time

import pytest
import torch

from pdctl.staging import held
from pdctl.staging.kernels import native

CUDA = torch.cuda.is_available()


def test_no_event_is_made_off_cuda_or_without_a_driver() -> None:
    assert held.held_event(torch.device("cpu")) is None
    if ctypes.util.find_library("cuda") is None:  # a machine without the driver: torch's
        assert held.driver() is None
        assert held.held_event(torch.device("cuda")) is None
        assert held.held_graph(object()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_held_events_order_and_time_device_work() -> None:
    device = torch.device("cuda")
    torch.cuda.synchronize()
    begin, end = held.held_event(device), held.held_event(device)
    assert begin is not None and end is not None
    # torch's events around the same sleep: a sleep counts clock cycles, and the first
    # one after an idle spell runs while the clock ramps up (twice as long, once)
    reference_begin, reference_end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    reference_begin.record()
    torch.cuda._sleep(50_000_000)  # cuda-only: a device-side wait
    end.record()
    reference_end.record()
    assert not end.query()  # the sleep is still running
    assert end.unpassed() == held.CUDA_ERROR_NOT_READY
    end.synchronize()
    assert end.query() and end.unpassed() == 0
    reference_end.synchronize()
    ours, theirs = begin.elapsed_time(end), reference_begin.elapsed_time(reference_end)
    assert ours > 0 and 0.5 < ours / theirs < 2.0, (ours, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_a_graph_launched_through_the_driver_runs_what_torch_captured() -> None:
    device = torch.device("cuda")
    values = torch.zeros(1024, device=device)
    step = torch.arange(1024, dtype=torch.float32, device=device)
    graph = torch.cuda.CUDAGraph()  # cuda-only: graphs are CUDA's
    stream = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):  # cuda-only: graphs are CUDA's
        values.add_(step)
    torch.cuda.synchronize()
    values.zero_()
    launcher = held.held_graph(graph)
    assert launcher is not None
    current = held.stream_reader(device.index or 0)
    with torch.cuda.stream(stream):  # cuda-only: a CUDA stream
        assert current() == held.stream_handle(stream)  # read at the call, not when made
    assert current() == held.current_stream_handle(device.index or 0)
    for _ in range(3):
        launcher.launch(current())
    graph.replay()  # torch's own launch, in the same stream order
    torch.cuda.synchronize()
    assert torch.equal(values, 4 * step)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_a_held_record_does_not_wait_for_a_thread_holding_the_gil() -> None:
    """Beside a busy Python thread, a call that gives the GIL away may wait for it
    (200 `time.sleep(0)` show how long: the busy thread does not take it every time, so
    the mean is what is compared); 200 held records never give it away."""
    device = torch.device("cuda")
    torch.cuda.synchronize(device)  # a context on this thread, whatever ran before
    event = held.held_event(device)
    assert event is not None
    stop, running = threading.Event(), threading.Event()

    def spin() -> None:
        running.set()
        while not stop.is_set():
            sum(range(2000))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default (another test may have lowered it)
    thread = threading.Thread(target=spin)
    thread.start()
    running.wait()  # the spinning thread contends from the first measure on
    try:
        started = time.perf_counter()
        for _ in range(200):
            time.sleep(0)
        given_away = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(200):
            event.record()
        kept = time.perf_counter() - started
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert given_away > 200 * 0.0002, given_away  # the spinning thread really contends
    assert kept < given_away / 2, (kept, given_away)


class StandIns:
    """`held_replay.c` driven with stand-ins for libcuda's entry points (on any machine):
    each records its call, and returns the error set for it (0: success) or the next of
    its queued results."""

    def __init__(self) -> None:
        from pdctl.staging import held_replay

        library, why = held_replay.replay_library()
        if library is None:
            pytest.skip(f"no C compiler here: {why}")
        self.calls: list[tuple[object, ...]] = []
        self.failing: dict[str, int] = {}
        self.queued: dict[str, list[int]] = {}
        p, u = ctypes.c_void_p, ctypes.c_uint
        self.functions = (
            self.make("copy", ctypes.c_uint64, p, ctypes.c_size_t, p),
            self.make("record", p, p),
            self.make("wait", p, p, u),
            self.make("launch", p, p),
            self.make("query", p),
        )
        self.slot_ids = torch.full((8,), -1, dtype=torch.int64)  # the slot's pinned ids
        check = native.check_function() or 0
        addresses = [held_replay.address(f) for f in self.functions]
        ids = (0xD000, self.slot_ids.data_ptr(), 64)  # device, pinned, bytes
        handles = (0x51, 0xE1, 0x61, 0xE2)  # upload stream, its event, graph, slot's event
        args = held_replay.ReplayArgs(*addresses[:4], *ids, *handles, addresses[4], check, 8)
        self.replay = held_replay.HeldReplay(library, args, self.functions)

    def make(self, name: str, *argtypes: object) -> object:
        def stand_in(*args: object) -> int:
            self.calls.append((name, *args))
            queued = self.queued.get(name)
            return queued.pop(0) if queued else self.failing.get(name, 0)

        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(stand_in)  # type: ignore[arg-type]


FIVE_CALLS = [
    ("copy", 0xD000, None, 64, 0x51),  # the ids, on the upload stream (None: the slot's)
    ("record", 0xE1, 0x51),  # behind the copy
    ("wait", 0x5A, 0xE1, 0),  # the launching stream waits for it, nothing else
    ("launch", 0x61, 0x5A),
    ("record", 0xE2, 0x5A),  # the slot's event behind the graph
]


def five_calls(stand_ins: StandIns) -> list[tuple[object, ...]]:
    address = stand_ins.slot_ids.data_ptr()
    return [tuple(address if part is None else part for part in call) for call in FIVE_CALLS]


def test_a_replay_in_one_call_makes_the_five_driver_calls_in_order() -> None:
    """The copy ahead, its event, the launching stream's wait, the launch, the slot's
    event, in that order with the slot's handles; a failing call is named with its
    error, and nothing after it runs."""
    stand_ins = StandIns()
    stand_ins.replay.replay(0x5A)
    assert stand_ins.calls == five_calls(stand_ins)
    for name, step, error in (("wait", "cuStreamWaitEvent", 400), ("launch", "cuGraphLaunch", 719)):
        stand_ins.calls.clear()
        stand_ins.failing = {name: error}
        with pytest.raises(RuntimeError, match=f"{step} failed with error {error}"):
            stand_ins.replay.replay(0x5A)
        assert stand_ins.calls[-1][0] == name  # nothing ran after the failing call


def test_a_checked_replay_waits_checks_and_writes_the_ids_then_launches() -> None:
    """`pdctl_checked_replay`: the slot's event queried (a replay still running is
    waited for, the GIL given up, then queried again), the ids checked and written into
    the slot in the same call, then the five calls; ids it refuses launch nothing and
    leave the naming to the caller; the stamps grow when too few; a failing query is
    named."""
    stand_ins = StandIns()
    if not stand_ins.replay.checks:
        pytest.skip(f"the page check is not built here: {native.available()[1]}")
    ids = torch.tensor([5, 0, 7, 3, 9, 2, 1, 4], dtype=torch.int64)
    waits: list[int] = []
    stand_ins.queued["query"] = [600, 0]  # CUDA_ERROR_NOT_READY, then passed
    native.STAMPS.struct.size = 0  # too few words: grown on the way
    assert stand_ins.replay.replay_checked(ids.data_ptr(), 10, 0x5A, lambda: waits.append(1))
    assert waits == [1] and native.STAMPS.struct.size >= 10
    # queried: not ready (waited for), ready (the stamps grown), ready again (checked)
    assert stand_ins.calls == [("query", 0xE2)] * 3 + five_calls(stand_ins)
    assert stand_ins.slot_ids.tolist() == ids.tolist()
    for bad in ([5, 0, 7, 3, 9, 2, 1, 5], [5, 0, 7, 3, 9, 2, 1, 10], [-1, 0, 7, 3, 9, 2, 1, 4]):
        stand_ins.calls.clear()
        refused = torch.tensor(bad, dtype=torch.int64)
        assert not stand_ins.replay.replay_checked(refused.data_ptr(), 10, 0x5A, lambda: None)
        assert stand_ins.calls == [("query", 0xE2)]  # nothing copied nor launched
    native.STAMPS.struct.stamp = 0xFFFFFFFF - 1  # the generations run out on the way
    for _ in range(3):
        assert stand_ins.replay.replay_checked(ids.data_ptr(), 10, 0x5A, lambda: None)
    stand_ins.calls.clear()
    stand_ins.failing = {"query": 700}
    with pytest.raises(RuntimeError, match="cuEventQuery failed with error 700"):
        stand_ins.replay.replay_checked(ids.data_ptr(), 10, 0x5A, lambda: None)
    assert stand_ins.calls == [("query", 0xE2)]
