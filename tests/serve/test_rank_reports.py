"""Rank reports over the TP group: the record, the sender, rank 0's collector.

The collector is tested against an in-process queue with the TP group's contract,
then against a real `TPGroup` (gloo) of three spawned processes: two ranks report
from several threads at once, after rank 0 waited longer than the group's timeout
(a gloo wait that runs out closes every connection of its group), and every report
arrives once, whole, with its rank; the other way, their listeners on the control
channel (`publish`/`listen`) waited as long before rank 0 published. `test_pd.py`
runs the roles' side in prefill and decode TP 2 topologies, failures included.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from multiprocessing.synchronize import Barrier

import pytest

from pdctl.serve.pd.reports import (
    RankReport,
    ReportCollector,
    ReportSender,
    RoomReport,
)


def test_a_room_report_crosses_as_bytes_and_is_checked_again() -> None:
    report = RankReport(
        1, True, bytes=4096, segments=2, staging=True, notice="bell", transfer_ms=1.5, write_ms=0.25
    )
    assert RoomReport.from_bytes(RoomReport(7, report).to_bytes()) == RoomReport(7, report)
    failed = RankReport(2, False, "decode rank 2: KV corruption in room 9")
    assert RoomReport.from_bytes(RoomReport(9, failed).to_bytes()).report == failed
    malformed = [
        b"[]",
        b'{"rank": 1, "ok": true}',  # no room
        b'{"room": -1, "rank": 1, "ok": true}',
        b'{"room": 1, "rank": 1, "ok": false}',  # failed, but not saying why
        b"\xff",
    ]
    for bad in malformed:
        with pytest.raises(ValueError):
            RoomReport.from_bytes(bad)


class QueueChannel:
    """The TP group's report channel in one process: ranks report, rank 0 collects."""

    def __init__(self, ranks: int) -> None:
        self.messages: queue.Queue[tuple[int, bytes | None]] = queue.Queue()
        self.ranks, self.ended = ranks, 0

    def sender(self, rank: int) -> ReportSender:
        channel = self

        class Rank:
            def report(self, message: bytes | None) -> None:
                channel.messages.put((rank, message))

            def collect(self) -> tuple[int, bytes] | None:
                raise AssertionError("only rank 0 collects")

        return ReportSender(Rank())

    def report(self, message: bytes | None) -> None:
        raise AssertionError("rank 0 reports to itself by a call")

    def collect(self) -> tuple[int, bytes] | None:
        while self.ended < self.ranks:
            rank, message = self.messages.get(timeout=10)
            if message is None:
                self.ended += 1
                continue
            return rank, message
        return None


def test_the_collector_hands_every_report_to_rank_0s_handler_until_the_ranks_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel = QueueChannel(ranks=2)
    delivered: list[tuple[int, RankReport]] = []

    def deliver(room: int, report: RankReport) -> None:
        if room == 13:
            raise RuntimeError("a bug in one room's handler")
        delivered.append((room, report))

    collector = ReportCollector(channel, deliver)
    one, two = channel.sender(1), channel.sender(2)
    one(5, RankReport(1, True, bytes=100, segments=1, transfer_ms=2.0))
    two(13, RankReport(2, True))  # its handler fails: the collector goes on
    channel.messages.put((2, b"not json"))  # cannot come from a ReportSender: skipped
    two(5, RankReport(2, False, "decode rank 2: receive timed out"))
    one.close()
    two.close()
    collector.thread.join(10)
    assert not collector.thread.is_alive()  # every rank ended
    assert delivered == [
        (5, RankReport(1, True, bytes=100, segments=1, transfer_ms=2.0)),
        (5, RankReport(2, False, "decode rank 2: receive timed out")),
    ]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("room 13 of rank 2" in m for m in errors)
    assert any("rank 2 sent a malformed report" in m for m in errors)


def test_a_report_rank_0_would_refuse_fails_on_the_sending_rank() -> None:
    """The sender reports the room failed instead (as it did when rank 0 answered 400)."""
    channel = QueueChannel(ranks=1)
    with pytest.raises(ValueError, match="bytes must be a non-negative number"):
        channel.sender(1)(5, RankReport(1, True, bytes=-1))
    assert channel.messages.empty()
    long = RankReport(1, False, "x" * 5000)
    assert long.checked().error == "x" * 2000  # as rank 0 reads it


def test_a_collector_whose_ranks_are_gone_ends() -> None:
    class Gone:
        def report(self, message: bytes | None) -> None:
            raise RuntimeError("Connection closed by peer")

        def collect(self) -> tuple[int, bytes] | None:
            raise RuntimeError("Connection closed by peer")

    collector = ReportCollector(Gone(), lambda room, report: None)
    collector.thread.join(10)
    assert not collector.thread.is_alive()
    ReportSender(Gone()).close()  # nothing to tell a rank 0 that is gone


ROOMS, THREADS, IDLE_S = 20, 4, 2.5


def _error(rank: int, room: int) -> str | None:
    """Every third room fails, with a long text."""
    return None if room % 3 else f"rank {rank} failed room {room}: {'x' * 1500}"


def _rank(rank: int, port: int, ready: Barrier, results: mp.Queue) -> None:
    """Rank 0 collects; ranks 1 and 2 wait IDLE_S (the group's timeout is 1 s), then
    report ROOMS rooms from THREADS threads each, then end. Meanwhile they listen on
    the control channel, where rank 0 publishes only once they ended."""
    import torch

    from pdctl.serve.tp import TPGroup

    torch.set_num_threads(1)
    ready.wait(60)  # every rank imported: the rendezvous has the group's 1 s timeout too
    group = TPGroup(rank, 3, "127.0.0.1", port, "gloo", 1)
    try:
        if rank == 0:
            got: list[tuple[int, RoomReport]] = []
            started = time.monotonic()
            while (message := group.collect()) is not None:
                got.append((message[0], RoomReport.from_bytes(message[1])))
            idle = time.monotonic() - started
            group.publish(b"room 7 changed")
            group.publish(None)
            rooms = sorted((r.room, r.report.rank, sender, r.report.error) for sender, r in got)
            want = sorted((room, r, r, _error(r, room)) for r in (1, 2) for room in range(ROOMS))
            whole = rooms == want and idle >= IDLE_S - 0.5
            results.put((0, "ok" if whole else f"idle {idle:.1f} s, got {rooms}"))
        else:
            heard: list[bytes | None] = []
            listener = threading.Thread(
                target=lambda: heard.extend([group.listen(), group.listen()])
            )
            listener.start()
            time.sleep(IDLE_S)
            report = ReportSender(group)

            def send(rooms: range) -> None:
                for room in rooms:
                    error = _error(rank, room)
                    report(room, RankReport(rank, error is None, error))

            threads = [
                threading.Thread(target=send, args=(range(t, ROOMS, THREADS),))
                for t in range(THREADS)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            report.close()
            listener.join(30)
            results.put((rank, "ok" if heard == [b"room 7 changed", None] else repr(heard)))
    except BaseException as exc:
        results.put((rank, repr(exc)))
    finally:
        group.close()


def test_reports_cross_a_real_tp_group_whole_after_a_long_idle() -> None:
    from tests.serve.conftest import free_port, in_spawned_ranks

    ready = mp.get_context("spawn").Barrier(3)
    answers = in_spawned_ranks(_rank, 3, free_port(), ready)
    assert answers == {0: "ok", 1: "ok", 2: "ok"}
