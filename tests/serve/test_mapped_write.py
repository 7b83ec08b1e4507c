"""The mapped write's host-side accounting: the garbage collector's clock and the
enqueue profile a server logs (PDCTL_WRITE_PROFILE)."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest

from pdctl.serve.pd import mapped_write
from pdctl.serve.pd.mapped_write import EnqueueProfile, GcClock

BUSY = sum(i * i for i in range(20_000))


def _busy_enqueue_part() -> int:
    return sum(i * i for i in range(20_000))


def _another_threads_work() -> None:
    for _ in range(50):
        sum(range(1000))
        time.sleep(0.001)


def test_gc_clock_counts_this_threads_collections() -> None:
    clock = GcClock()
    clock.install()
    clock.install()  # once only
    try:
        assert gc.callbacks.count(clock._callback) == 1
        before = clock.seconds()
        for _ in range(3):
            gc.collect()
        assert clock.seconds() > before
    finally:
        gc.callbacks.remove(clock._callback)


def test_enqueue_profile_logs_the_functions_after_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    profile = EnqueueProfile(2)
    other = threading.Thread(target=_another_threads_work)
    with caplog.at_level(logging.INFO, logger="pdctl.serve"):
        assert profile.run(_busy_enqueue_part) == BUSY
        assert "enqueue profile" not in caplog.text  # one of two so far
        other.start()
        assert profile.run(_busy_enqueue_part) == BUSY
        other.join()
        assert profile.run(_busy_enqueue_part) == BUSY  # past its count: unprofiled
    reports = [r for r in caplog.records if "enqueue profile" in r.getMessage()]
    assert len(reports) == 1
    text = reports[0].getMessage()
    assert "_busy_enqueue_part" in text
    assert "_another_threads_work" not in text  # only the calling thread's calls
    assert "function calls" in text
    assert profile.left == 0


def test_enqueue_profile_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    profile = EnqueueProfile(0)
    with caplog.at_level(logging.INFO, logger="pdctl.serve"):
        assert profile.run(_busy_enqueue_part) == BUSY
    assert caplog.text == "" and profile.stats is None


@pytest.mark.parametrize(("raw", "count"), [("", 0), ("0", 0), ("5", 5), ("-3", 0), ("x", 0)])
def test_write_profile_count_parsed(raw: str, count: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdctl.serve"):
        assert mapped_write._profiled_count(raw) == count
    assert ("not a count" in caplog.text) == (raw == "x")


def test_a_profiled_method_gets_its_arguments_and_gives_its_result() -> None:
    class Writer:
        def __init__(self) -> None:
            self.profile = EnqueueProfile(1)

        @mapped_write._profiled
        def start(self, room: int, pages: list[int], *, peer: str = "") -> tuple:
            return room, pages, peer

    writer = Writer()
    assert writer.start(7, [1, 2], peer="decode") == (7, [1, 2], "decode")  # profiled
    assert writer.profile.left == 0 and writer.profile.stats is not None
    assert writer.start(8, []) == (8, [], "")  # past the count
