"""The shared-memory TP gather and step broadcast between real processes: gloo's
bytes, in rank order.

Two processes gather a few hundred tensors of changing shapes and dtypes (both slot
parities many times over), with rank 0's broadcasts of changing lengths in between
(some too large for a slot: None on both ranks); each checks every result bit for bit
against what it knows the other rank sent. A rank that never arrives is a timeout
naming it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
import torch

from pdctl.serve import tp_shm
from tests.serve.conftest import in_spawned_ranks

pytestmark = pytest.mark.skipif(not tp_shm.available(), reason="no futex or /dev/shm here")
ROUNDS = 300


def _payload(rank: int, step: int) -> torch.Tensor:
    rows = 1 + step % 7
    generator = torch.Generator().manual_seed(step * 10 + rank)
    values = torch.randn(rows, 48, generator=generator)
    return values.to(torch.bfloat16) if step % 3 == 0 else values


def _message(step: int) -> torch.Tensor:
    """Rank 0's broadcast at `step`: a step's int64s, every fifth one too large for a slot."""
    count = tp_shm.SLOT_BYTES // 8 if step % 5 == 0 else 1 + step % 40
    return torch.arange(count, dtype=torch.int64) * 7 + step


def _rank(rank: int, path: str, world: int, results: mp.Queue) -> None:
    shared = tp_shm.SharedGather(path, rank, world, timeout_s=30)
    try:
        for step in range(ROUNDS):
            if step % 3 != 2:  # a broadcast between gathers, as a step's announcement is
                message = _message(step)
                heard = shared.broadcast(message if rank == 0 else None)
                fits = (message.numel() + 1) * 8 <= tp_shm.SLOT_BYTES
                if (heard is not None) != fits or (fits and not torch.equal(heard, message)):
                    results.put((rank, f"step {step}: the broadcast came out wrong"))
                    return
            got = shared.gather(_payload(rank, step))
            want = torch.cat([_payload(r, step) for r in range(world)])
            same = got.dtype == want.dtype and torch.equal(
                got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
            )
            if not same:
                results.put((rank, f"step {step}: gathered values differ"))
                return
        results.put((rank, "ok"))
    finally:
        shared.close()


def test_two_processes_gather_each_others_bytes_in_rank_order() -> None:
    path = f"/dev/shm/pdctl-test-{uuid.uuid4().hex}"
    tp_shm.SharedGather.create(path, 2)
    try:
        assert in_spawned_ranks(_rank, 2, path, 2) == {0: "ok", 1: "ok"}
    finally:
        tp_shm.unlink(path)
    assert not os.path.exists(path)


@pytest.mark.parametrize("operation", ["gather", "broadcast"])
def test_a_rank_that_never_arrives_is_a_timeout_naming_it(operation: str) -> None:
    path = f"/dev/shm/pdctl-test-{uuid.uuid4().hex}"
    tp_shm.SharedGather.create(path, 2)
    try:
        alone = tp_shm.SharedGather(path, 0, 2, timeout_s=0.5)
        call = getattr(alone, operation)
        with pytest.raises(TimeoutError, match=r"TP rank 1 did not reach gather 1 within 0\.5 s"):
            call(torch.ones(4, dtype=torch.int64))
        if operation == "broadcast":  # the last message (a stop) waits for no reader
            stop = torch.tensor([2], dtype=torch.int64)
            assert torch.equal(alone.broadcast(stop, last=True), stop)
        alone.close()  # rank 0 unlinks the file
        assert not os.path.exists(path)
    finally:
        tp_shm.unlink(path)


def test_large_payloads_are_left_to_the_collective() -> None:
    path = f"/dev/shm/pdctl-test-{uuid.uuid4().hex}"
    tp_shm.SharedGather.create(path, 1)
    try:
        shared = tp_shm.SharedGather(path, 0, 1, timeout_s=1)
        assert shared.fits(torch.ones(1024))
        assert not shared.fits(torch.ones(tp_shm.SLOT_BYTES // 4 + 1))
        assert torch.equal(
            shared.gather(torch.arange(6.0).view(2, 3)), torch.arange(6.0).view(2, 3)
        )
        shared.close()
    finally:
        tp_shm.unlink(path)


def _group_rank(rank: int, port: int, results: mp.Queue) -> None:
    """A two-rank TPGroup (gloo, shared file). Rank 0's forward has another thread send
    an ABORT in the middle of its gathers; rank 1 must see the forward, the gathers
    intact, then the ABORT, then the STOP."""
    import threading

    from pdctl.serve.tp import TPGroup
    from pdctl.serve.tp_ops import Op

    torch.set_num_threads(1)
    group = TPGroup(rank, 2, "127.0.0.1", port, "gloo", 30)
    try:
        assert group.shared is not None
        if rank == 0:

            def run() -> list[torch.Tensor]:
                gathered = [group.gather(_payload(0, 0))]
                sender = threading.Thread(target=group.send, args=(Op.ABORT, torch.arange(5)))
                sender.start()
                sender.join(timeout=10)  # queued behind this forward, not sent in its middle
                gathered += [group.gather(_payload(0, step)) for step in (1, 2)]
                return gathered

            got = group.forward(torch.arange(3), run)
            group.send(Op.STOP, last=True)
        else:
            op, payload = group.receive()
            assert op == Op.FORWARD and payload.tolist() == [0, 1, 2], (op, payload)
            got = [group.gather(_payload(1, step)) for step in (0, 1, 2)]
            op, payload = group.receive()
            assert op == Op.ABORT and payload.tolist() == [0, 1, 2, 3, 4], (op, payload)
            op, _ = group.receive()
            assert op == Op.STOP, op
        for step, tensor in enumerate(got):
            want = torch.cat([_payload(r, step) for r in range(2)])
            assert torch.equal(tensor.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
        results.put((rank, "ok"))
    except BaseException as exc:
        results.put((rank, repr(exc)))
    finally:
        group.close()


def test_a_message_sent_during_a_forward_goes_out_after_its_gathers() -> None:
    from tests.serve.conftest import free_port

    assert in_spawned_ranks(_group_rank, 2, free_port()) == {0: "ok", 1: "ok"}
