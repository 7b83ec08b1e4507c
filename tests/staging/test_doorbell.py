"""Doorbells (`staging.doorbell`): rings from another process's host, from the device's
launch (the Triton ring interpreted on the CPU here; on a GPU into the box mapped for
the device), half-visible rings never taken, tickets never reused while a late ring
may come."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.staging import doorbell
from pdctl.staging.digest import digests_of_sums
from pdctl.staging.doorbell import (
    CHECK,
    DIGESTS,
    SUMS,
    BellBox,
    BellRinger,
    BoxInfo,
    Ticket,
    check_word,
)
from pdctl.staging.kernels.bell import ring_from_device

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # the Triton ring: compiled on a GPU, interpreted here
RING_IN_CHILD = """
import json, sys
from pdctl.staging.doorbell import BellRinger, BoxInfo, Ticket
info, slot, seq, values = json.loads(sys.argv[1])
BellRinger(BoxInfo.from_json(info)).ring(Ticket(slot, seq), 1, values)
"""


def test_another_process_rings_and_the_receiver_wakes_at_once() -> None:
    import json

    with BellBox(4, 16) as box:
        ticket = box.ticket()
        assert ticket is not None and box.read(ticket) is None
        values = [5, -1, 2**62, -(2**63)]
        argument = json.dumps([box.info.to_json(), ticket.slot, ticket.seq, values])
        child = subprocess.Popen([sys.executable, "-c", RING_IN_CHILD, argument])
        rung = box.wait(ticket, 30.0)  # asleep on the futex until the child's wake
        assert child.wait(30) == 0
        assert rung is not None
        kind, got = rung
        assert kind == SUMS and got.tolist() == values


def test_a_host_ring_wakes_a_sleeping_receiver_at_once() -> None:
    with BellBox(2, 8) as box, BellRinger(box.info) as ringer:
        ticket = box.ticket()
        assert ticket is not None
        rang_at: list[float] = []

        def ring() -> None:
            time.sleep(0.2)
            rang_at.append(time.monotonic())
            ringer.ring(ticket, DIGESTS, [1, 2, 3])

        thread = threading.Thread(target=ring)
        thread.start()
        rung = box.wait(ticket, 10.0)
        woke = time.monotonic()
        thread.join()
        assert rung is not None and rung[1].tolist() == [1, 2, 3]
        # a futex wake, not the end of the 10 s wait (generous for a loaded machine)
        assert woke - rang_at[0] < 1.0


def test_a_half_visible_ring_is_not_taken() -> None:
    with BellBox(2, 8) as box, BellRinger(box.info) as ringer:
        ticket = box.ticket()
        assert ticket is not None
        ringer.ring(ticket, SUMS, [7, 8, 9])
        words, base = box._mapped.words, box._mapped.base(ticket.slot)
        words[base + doorbell.SLOT_HEADER + 1] = 99  # a value not yet arrived (as seen here)
        assert box.read(ticket) is None
        assert box.wait(ticket, 0.05) is None  # announced: looked at closely, still torn
        words[base + doorbell.SLOT_HEADER + 1] = 8
        assert box.read(ticket) is not None
        words[base + CHECK] ^= 1
        assert box.read(ticket) is None


def test_a_ring_with_another_sequence_number_is_not_this_tickets() -> None:
    with BellBox(2, 8) as box, BellRinger(box.info) as ringer:
        first = box.ticket()
        assert first is not None
        ringer.ring(Ticket(first.slot, first.seq + 100), DIGESTS, [1])  # a late, stale ring
        assert box.read(first) is None
        ringer.ring(first, DIGESTS, [2])
        assert box.read(first) == (DIGESTS, np.array([2]))


def test_tickets_are_new_numbers_and_given_up_slots_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    with BellBox(3, 4) as box:
        tickets = [box.ticket() for _ in range(3)]
        assert None not in tickets and box.ticket() is None  # every slot in use
        assert len({t.seq for t in tickets if t}) == 3 and all(t and t.seq > 0 for t in tickets)
        assert tickets[0] and tickets[1]
        box.release(tickets[0])
        again = box.ticket()
        assert again is not None and again.slot == tickets[0].slot and again.seq > tickets[2].seq
        box.quarantine(tickets[1])  # a late ring may still come: not handed out
        assert box.ticket() is None
        monkeypatch.setattr(doorbell, "RECLAIM_S", 0.0)  # ... until no writer can be writing
        reclaimed = box.ticket()
        assert reclaimed is not None and reclaimed.slot == tickets[1].slot


def test_a_ringer_refuses_another_box_and_too_many_values(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with BellBox(2, 4) as box:
        info = box.info
        with pytest.raises(OSError, match="another box"):
            BellRinger(BoxInfo(info.path, info.nonce ^ 1, info.slots, info.slot_words))
        with pytest.raises(OSError, match="not a bell box"):
            BellRinger(BoxInfo(info.path, info.nonce, info.slots + 1, info.slot_words))
        other = tmp_path / "other"
        other.write_bytes(b"\0" * info.nbytes)
        with pytest.raises(OSError, match="another box"):
            BellRinger(BoxInfo(str(other), info.nonce, info.slots, info.slot_words))
        ticket = box.ticket()
        assert ticket is not None
        with BellRinger(info) as ringer, pytest.raises(ValueError, match="do not fit"):
            ringer.ring(ticket, DIGESTS, list(range(5)))


@pytest.mark.parametrize(
    "data",
    [
        {"path": "/x", "nonce": 1, "slots": 2},
        {"path": "", "nonce": 1, "slots": 2, "slot_words": 16},
        {"path": "/x", "nonce": -1, "slots": 2, "slot_words": 16},
        {"path": "/x", "nonce": 1, "slots": 2, "slot_words": 8},
        {"path": "/x", "nonce": True, "slots": 2, "slot_words": 16},
        [],
    ],
)
def test_a_bad_box_description_is_refused(data: object) -> None:
    with pytest.raises(ValueError, match="bell box"):
        BoxInfo.from_json(data)


def test_a_slots_device_address_is_its_offset_from_where_the_box_is_mapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`device_slot`: a slot lies as far from the box's device address (a stand-in
    mapping here) as from its host one; a slot outside the box is refused."""
    from pdctl.staging import hostmap

    asked = []

    def mapped(address: int, size: int, device: torch.device) -> int:
        asked.append((address, size, device))
        return 1 << 40

    cuda = torch.device("cuda")
    with BellBox(3, 8) as box, BellRinger(box.info) as ringer:
        monkeypatch.setattr(hostmap, "device_address", mapped)
        box_address = ringer.slot_address(0) - 8 * doorbell.HEADER_WORDS
        for slot in range(3):
            offset = ringer.slot_address(slot) - box_address
            assert ringer.device_slot(slot, cuda) == (1 << 40) + offset
        assert asked[0] == (box_address, box.info.nbytes, cuda)
        with pytest.raises(ValueError, match="outside the box"):
            ringer.device_slot(3, cuda)


def _device_ring(box: BellBox, ringer: BellRinger, ticket: Ticket, values: torch.Tensor) -> None:
    """`ring_from_device` into `box` (its slot address for the device: the host's on the
    CPU, where the interpreter runs the kernel)."""
    if values.device.type == "cuda":
        address = ringer.device_slot(ticket.slot, values.device)
        assert address is not None
    else:
        assert ringer.device_slot(ticket.slot, values.device) is None  # no device path here
        address = ringer.slot_address(ticket.slot)
    count = values.numel()
    ids = torch.tensor([3, 4, address, ticket.seq, count], dtype=torch.int64, device=values.device)
    ring_from_device(ids, 2, torch.cat([values, values[:1] + 1]), SUMS)  # the count is the ids'


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40))
def test_the_device_ring_carries_the_values_and_the_hosts_check_word(values: list[int]) -> None:
    with BellBox(1, 64) as box, BellRinger(box.info) as ringer:
        ticket = box.ticket()
        assert ticket is not None
        _device_ring(box, ringer, ticket, torch.tensor(values, dtype=torch.int64, device=DEVICE))
        rung = box.read(ticket)
        assert rung is not None
        assert rung[0] == SUMS and rung[1].tolist() == values
        assert check_word(ticket.seq, SUMS, rung[1]) == box._mapped.words[
            box._mapped.base(ticket.slot) + CHECK
        ].astype(np.uint64)


def test_a_device_ring_walks_more_values_than_one_step_holds() -> None:
    from pdctl.staging.kernels import bell

    with BellBox(1, 3 * bell.BLOCK) as box, BellRinger(box.info) as ringer:
        ticket = box.ticket()
        assert ticket is not None
        values = torch.arange(2 * bell.BLOCK + 5, dtype=torch.int64, device=DEVICE) * (2**40 + 1)
        _device_ring(box, ringer, ticket, values)
        rung = box.read(ticket)
        assert rung is not None and rung[1].tolist() == values.cpu().tolist()


def test_a_device_ring_is_heard_without_an_announcement() -> None:
    """A ring nobody announced (the writer's host died after the launch, say) is still
    read at the receiver's next look."""
    with BellBox(1, 8) as box, BellRinger(box.info) as ringer:
        ticket = box.ticket()
        assert ticket is not None
        _device_ring(box, ringer, ticket, torch.tensor([11, 12], dtype=torch.int64, device=DEVICE))
        assert box.wait(ticket, 0.01) == (SUMS, pytest.approx(np.array([11, 12])))
        words = box._mapped.words
        sums = words[box._mapped.base(ticket.slot) + doorbell.SLOT_HEADER :][:2]
        assert digests_of_sums(sums, np.array([4, 4])) == digests_of_sums(
            np.array([11, 12]), np.array([4, 4])
        )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_the_device_rings_a_box_of_host_memory_from_a_cuda_graph() -> None:
    """The box mapped for the device: a graph's replays ring a new slot each, read
    from the ids uploaded before each replay."""
    with BellBox(4, 16) as box, BellRinger(box.info) as ringer:
        values = torch.arange(1, 9, dtype=torch.int64, device="cuda") * -3
        pinned = torch.zeros(5, dtype=torch.int64, pin_memory=True)
        ids = torch.zeros(5, dtype=torch.int64, device="cuda")
        first = box.ticket()
        assert first is not None
        _device_ring(box, ringer, first, values)  # compiles the kernel before the capture
        assert box.wait(first, 5.0) is not None
        box.release(first)
        ids.copy_(pinned)
        graph = torch.cuda.CUDAGraph()  # cuda-only: the graph under test
        stream = torch.cuda.Stream()  # cuda-only: capture on a side stream
        with torch.cuda.graph(graph, stream=stream):  # cuda-only: the graph under test
            ids.copy_(pinned, non_blocking=True)
            ring_from_device(ids, 2, values, SUMS)
        for _ in range(3):
            ticket = box.ticket()
            assert ticket is not None
            address = ringer.device_slot(ticket.slot, values.device)
            assert address is not None
            pinned[2], pinned[3], pinned[4] = address, ticket.seq, 8
            graph.replay()
            rung = box.wait(ticket, 5.0)
            assert rung is not None and rung[1].tolist() == values.cpu().tolist()
            box.release(ticket)
