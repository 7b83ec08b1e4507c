"""One bounded poll for every test that waits on another process or thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Call `predicate` until it returns something true, and return that; after
    `timeout` seconds raise AssertionError naming `what` was awaited (and the last
    exception `predicate` raised, if any: a server still starting refuses)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # a server still starting refuses: reported at the timeout
            last = exc
        if time.monotonic() > deadline:
            detail = f" (last: {type(last).__name__}: {last})" if last else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(interval)
