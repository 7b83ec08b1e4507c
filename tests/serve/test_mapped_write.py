"""The mapped write's host-side accounting: the garbage collector's clock and the
enqueue profile a server logs (PDCTL_WRITE_PROFILE)."""

from __future__ import annotations

import gc
import logging

import pytest

from pdctl.serve.pd import mapped_write
from pdctl.serve.pd.mapped_write import EnqueueProfile, GcClock


def _busy_enqueue_part() -> int:
    return sum(i * i for i in range(20_000))


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
    with caplog.at_level(logging.INFO, logger="pdctl.serve"):
        with profile:
            _busy_enqueue_part()
        assert "enqueue profile" not in caplog.text  # one of two so far
        with profile:
            _busy_enqueue_part()
        with profile:  # past its count: runs unprofiled, logs nothing more
            _busy_enqueue_part()
    reports = [r for r in caplog.records if "enqueue profile" in r.getMessage()]
    assert len(reports) == 1
    text = reports[0].getMessage()
    assert "_busy_enqueue_part" in text
    assert "function calls" in text
    assert profile.left == 0


def test_enqueue_profile_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    profile = EnqueueProfile(0)
    assert profile.profile is None
    with caplog.at_level(logging.INFO, logger="pdctl.serve"), profile:
        _busy_enqueue_part()
    assert caplog.text == ""


@pytest.mark.parametrize(("raw", "count"), [("", 0), ("0", 0), ("5", 5), ("-3", 0), ("x", 0)])
def test_write_profile_count_parsed(raw: str, count: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdctl.serve"):
        assert mapped_write._profiled_count(raw) == count
    assert ("not a count" in caplog.text) == (raw == "x")
