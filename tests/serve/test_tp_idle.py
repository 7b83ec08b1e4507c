"""TP ranks > 0 wait for rank 0's next step for as long as the server idles.

A real `TPGroup` of three spawned processes with a group timeout of 1 s: rank 0 stays
silent for more than twice that timeout before its first message and again between
two forwards; the other ranks, in `worker_loop`, must run every message in order (the
ABORT's payload, each forward with its gather, the stop), none of their waits failing
(a gloo wait that runs out closes every connection of its group). Once over gloo
alone (`shared_memory=False`, as `tp_gather: gloo` serves) and once with a composite
backend (`cpu:gloo`: like `cpu:gloo,cuda:nccl` on a GPU, no shared file, the step's
header rides the default group's gloo half). And a rank 0 that dies while another rank
waits is noticed at once, neither at a deadline nor never.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Sequence
from functools import partial
from multiprocessing.synchronize import Barrier
from typing import Any

import pytest
import torch

from pdctl.serve.model.batch import Piece
from pdctl.serve.tp import TPGroup

TIMEOUT_S, IDLE_S = 1, 2.5  # the group's timeout; how long rank 0 stays silent


def _rows(rank: int, step: int) -> torch.Tensor:
    """A rank's partial in the forward of `step`."""
    return torch.full((2, 3), 10.0 * rank + step)


def _gathered(world: int, step: int) -> torch.Tensor:
    return torch.cat([_rows(r, step) for r in range(world)])


def _piece(step: int) -> Piece:
    return Piece(torch.arange(4) + step, step, torch.arange(step + 4), True)


def _run(target: Any, world: int, *args: object) -> dict[int, str]:
    """`target(rank, world, port, ready, *args, results)` in `world` spawned processes;
    each one's answer, by rank."""
    from tests.serve.conftest import free_port, in_spawned_ranks

    ready = mp.get_context("spawn").Barrier(world)
    return in_spawned_ranks(target, world, world, free_port(), ready, *args)


def _group(rank: int, world: int, port: int, ready: Barrier, backend: str) -> TPGroup:
    """This rank's group, once every rank finished its imports (the rendezvous has the
    group's short timeout too, and must not wait for another process's imports)."""
    ready.wait(60)
    return TPGroup(rank, world, "127.0.0.1", port, backend, TIMEOUT_S, shared_memory=False)


def _idle_rank(
    rank: int, world: int, port: int, ready: Barrier, backend: str, results: mp.Queue
) -> None:
    """Rank 0: silence, an ABORT and a forward, silence, a forward and the stop. The
    others: `worker_loop`, noting what they ran."""
    from pdctl.serve.tp import encode_pieces, worker_loop
    from pdctl.serve.tp_ops import Op

    torch.set_num_threads(1)
    group = None
    try:
        group = _group(rank, world, port, ready, backend)
        assert group.shared is None
        if rank == 0:
            time.sleep(IDLE_S)
            group.send(Op.ABORT, torch.arange(5))
            for step in (1, 2):
                if step == 2:
                    time.sleep(IDLE_S)
                gather = partial(group.gather, _rows(0, step))
                got = group.forward(encode_pieces([_piece(step)]), gather)
                assert torch.equal(got, _gathered(world, step)), (step, got)
            group.send(Op.STOP, last=True)
            results.put((0, "ok"))
            return
        heard: list[object] = []
        group.handlers[Op.ABORT] = lambda payload: heard.append(payload.tolist())

        def forward(pieces: Sequence[Piece]) -> None:
            (piece,) = pieces
            want = _piece(piece.start)
            same = torch.equal(piece.tokens, want.tokens) and torch.equal(piece.rows, want.rows)
            gathered = group.gather(_rows(rank, piece.start))
            heard.append((piece.start, same, torch.equal(gathered, _gathered(world, piece.start))))

        started = time.monotonic()
        worker_loop(group, forward)
        idle = time.monotonic() - started
        whole = heard == [[0, 1, 2, 3, 4], (1, True, True), (2, True, True)]
        results.put((rank, "ok" if whole and idle >= 2 * IDLE_S - 0.5 else f"{heard} {idle:.1f}"))
    except BaseException as exc:
        results.put((rank, repr(exc)))
    finally:
        if group is not None:
            group.close()


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo"])
def test_ranks_wait_for_the_next_step_longer_than_the_groups_timeout(backend: str) -> None:
    assert _run(_idle_rank, 3, backend) == {0: "ok", 1: "ok", 2: "ok"}


def _dying_rank(rank: int, world: int, port: int, ready: Barrier, results: mp.Queue) -> None:
    """Rank 0 stays silent past the group's timeout, then dies (SIGKILL); rank 1 waits
    for its next step meanwhile, and answers how long it waited."""
    from pdctl.serve.tp import worker_loop

    torch.set_num_threads(1)
    group = None
    try:
        group = _group(rank, world, port, ready, "gloo")
        started = time.monotonic()
        if rank == 0:
            time.sleep(IDLE_S)
            results.put((0, "dies"))
            results.close()
            results.join_thread()  # the answer is out before the process ends
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            worker_loop(group, lambda pieces: None)
            answer = "returned"
        except RuntimeError:
            answer = f"{time.monotonic() - started:.1f}"
        results.put((rank, answer))
    except BaseException as exc:
        results.put((rank, repr(exc)))
    finally:
        if group is not None:
            group.close()


def test_a_waiting_rank_notices_at_once_that_rank_0_died() -> None:
    """gloo fails the wait when rank 0's connections close. (A server's rank also dies
    with rank 0's process: `ranks.die_with_parent`.)"""
    answers = _run(_dying_rank, 2)
    assert answers[0] == "dies", answers
    waited = answers[1]  # seconds, once rank 0 died; else what rank 1 said
    assert waited.replace(".", "").isdigit(), answers
    assert IDLE_S - 0.5 <= float(waited) <= IDLE_S + 5, answers
