"""A target's reference server started early: it serves once waited for, and a close
while it is still starting leaves no process behind (real servers on loopback)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from pdctl.launch.plan import load_checked, make_plan
from pdctl.verify.targets import url_target

TOPOLOGY = Path(__file__).parents[2] / "topologies" / "cpu-p1d2-tcp.yaml"


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def reference_pgid(target) -> int:  # type: ignore[no-untyped-def]
    spawned = target._reference_run.states[-1].spawned
    assert spawned is not None
    return spawned.pid


def test_a_reference_started_early_serves_and_is_stopped_with_the_target() -> None:
    target = url_target("http://127.0.0.1:9", make_plan(load_checked(TOPOLOGY)))
    try:
        target.start_reference_early()
        pgid = reference_pgid(target)  # spawned at once, on this thread
        url = target.reference()  # waits for its probes
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert target.reference() == url  # started once
    finally:
        target.close()
    assert not group_alive(pgid)


def test_a_close_while_the_reference_starts_leaves_nothing_running() -> None:
    target = url_target("http://127.0.0.1:9", make_plan(load_checked(TOPOLOGY)))
    target.start_reference_early()
    pgid = reference_pgid(target)
    target.close()  # the reference, spawned at once, is stopped with the rest
    assert not group_alive(pgid)
