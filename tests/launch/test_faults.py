"""Faults survived: a role or rank dies, a peer stops answering, a transfer is too slow,
the router dies. Real topologies through the launcher, real processes, loopback.

In each case the requests the fault touches fail within the timeouts with an error
naming the role, the others complete with the right tokens, the surviving servers
stay healthy and give back every KV page and ring region, the launcher reports the
death with the log tail, and stopping the run leaves nothing running.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.processes import group_alive, group_members
from pdctl.launch.run import LaunchFailed, Run
from tests.polling import wait_until

PROMPT = [(j * 13) % 500 + 1 for j in range(60)]
BODY = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
TIMEOUTS = {"bootstrap_s": 3, "transfer_s": 3, "request_s": 20}


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PDCTL_STATE_DIR", str(tmp_path / "state"))
    yield


@pytest.fixture
def start(make_topology: Callable[..., Path], tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start(prefill: int = 1, decode: int = 1, faults: list[dict[str, Any]] | None = None) -> Run:
        path = make_topology(
            roles={"prefill": {"tp": 1, "replicas": prefill},
                   "decode": {"tp": 2, "replicas": decode}},
            transfer={"backend": "tcp", "timeouts": TIMEOUTS,
                      "staging": {"pool_size_mb": 2, "segment_size_mb": 0.5}},
            **({"faults": faults} if faults else {}),
        )  # fmt: skip
        run = Run(make_plan(load_checked(path)), tmp_path / f"run-{len(runs)}")
        runs.append(run)
        run.start()
        run.wait_ready(timeout=180)
        return run

    yield start
    for run in runs:
        pgids = [s.spawned.pid for s in run.states if s.spawned]
        assert run.stop() == []
        assert not any(group_alive(pgid) for pgid in pgids)  # nothing left running


def send(run: Run, timeout: float = 60) -> tuple[int, Any, float]:
    started = time.monotonic()
    try:
        response = httpx.post(f"{run.router_url}/generate", json=BODY, timeout=timeout)
    except httpx.HTTPError as exc:
        return 0, f"{type(exc).__name__}: {exc}", time.monotonic() - started
    body = response.json()
    value = body["output_ids"] if response.status_code == 200 else body["error"]["message"]
    return response.status_code, value, time.monotonic() - started


def burst(
    run: Run, count: int, during: Callable[[], None], ready: Callable[[], bool] | None = None
) -> list[Any]:
    """`count` concurrent requests; `during` runs once `ready()` holds (at once if None)."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(send, run) for _ in range(count)]
        if ready is not None:
            wait_until(ready, 30, "the burst's requests to reach the server under test")
        during()
        return [f.result() for f in futures]


def info(run: Run, name: str) -> dict[str, Any]:
    response = httpx.get(f"{run.state(name).url}/get_server_info", timeout=5)
    return dict(response.json())


def in_flight(run: Run, name: str, count: int) -> Callable[[], bool]:
    """`name` holds `count` requests admitted (a PD request stays so while its KV moves)."""
    return lambda: info(run, name)["running_requests"] >= count


def wait_dropped(run: Run, side: str, name: str) -> None:
    """The router's health check found `name` gone (it stops picking it)."""
    url = run.state(name).url

    def dropped() -> bool:
        workers = httpx.get(f"{run.router_url}/get_server_info", timeout=5).json()[side]
        return any(w["url"] == url and not w["healthy"] for w in workers)

    wait_until(dropped, 30, f"the router to drop {name}")


def pgid_of(run: Run, name: str) -> int:
    spawned = run.state(name).spawned
    assert spawned is not None
    return spawned.pid


def rank_pid(run: Run, name: str, rank: int) -> int:
    """The pid of TP rank `rank` (> 0) of a server: its rank-0 process's child."""
    leader = pgid_of(run, name)
    members = [p for p in group_members(leader) if p != leader]
    assert len(members) >= rank, members
    return sorted(members)[rank - 1]


def assert_death_reported(run: Run, name: str, role: str) -> None:
    """What `pdctl up` does when a process ends: name it, its role, and its log tail."""
    with pytest.raises(LaunchFailed) as failure:
        run.check_exits()
    assert failure.value.summary.startswith(f"{name} ({role}, pid ")
    assert f"{name}-tp0.log" in failure.value.report and "    | " in failure.value.report


def test_a_decode_rank_killed_mid_transfer(start: Callable[..., Run]) -> None:
    run = start(decode=2, faults=[{"name": "delay-transfer", "seconds": 1.5}])
    reference = send(run)[1]
    victim = rank_pid(run, "decode-1", 1)
    # half the burst is on decode-1 (round-robin), admitted and waiting for its KV
    results = burst(run, 6, lambda: os.kill(victim, signal.SIGKILL), in_flight(run, "decode-1", 3))
    failed = [r for r in results if r[0] != 200]
    done = [r for r in results if r[0] == 200]
    assert failed and done, results  # the router spread them over both decode servers
    assert all(r[1] == reference for r in done)
    for _, message, elapsed in failed:
        assert "decode-1 rank 1" in str(message) and run.state("decode-1").url in message
        assert elapsed < TIMEOUTS["request_s"] + 5, (elapsed, message)
    wait_dropped(run, "decode", "decode-1")
    assert send(run)[:2] == (200, reference)  # the survivors serve on
    ok, held, _ = run.pools_back(names=["prefill-0", "decode-0"])
    assert ok, held
    assert_death_reported(run, "decode-1", "decode")


def test_prefill_killed_mid_transfer(start: Callable[..., Run]) -> None:
    run = start(prefill=2, faults=[{"name": "delay-transfer", "seconds": 1.5}])
    reference = send(run)[1]
    kill = lambda: os.killpg(pgid_of(run, "prefill-1"), signal.SIGKILL)  # noqa: E731
    # half the burst is on prefill-1, computed and held by the delay before its send
    results = burst(run, 6, kill, in_flight(run, "prefill-1", 3))
    failed = [r for r in results if r[0] != 200]
    done = [r for r in results if r[0] == 200]
    assert failed and done, results
    assert all(r[1] == reference for r in done)
    for _, message, elapsed in failed:
        assert f"prefill {run.state('prefill-1').url} failed" in str(message), message
        assert elapsed < TIMEOUTS["request_s"] + 5, (elapsed, message)
    wait_dropped(run, "prefill", "prefill-1")
    assert send(run)[:2] == (200, reference)
    ok, held, _ = run.pools_back(names=["prefill-0", "decode-0"])
    assert ok, held
    assert_death_reported(run, "prefill-1", "prefill")


def test_a_transport_peer_that_stops_answering(start: Callable[..., Run]) -> None:
    """Decode rank 1 of decode-1 is frozen (SIGSTOP: a partition, a hung host) for 8 s."""
    run = start(decode=2)
    reference = send(run)[1]
    victim = rank_pid(run, "decode-1", 1)
    thaw = threading.Timer(8.0, os.kill, (victim, signal.SIGCONT))
    try:
        results = burst(run, 6, lambda: (os.kill(victim, signal.SIGSTOP), thaw.start()))
    finally:
        thaw.join()
        os.kill(victim, signal.SIGCONT)
    failed = [r for r in results if r[0] != 200]
    assert failed, results  # those paired with decode-1
    assert all(r[1] == reference for r in results if r[0] == 200)
    for _, message, elapsed in failed:
        # prefill waited for decode-1 to register the room; the router names the pair
        assert f"the request's decode: {run.state('decode-1').url}" in message, message
        assert elapsed < TIMEOUTS["request_s"] + 5, (elapsed, message)
    ok, held, _ = run.pools_back(timeout=60)  # every server, the thawed one too
    assert ok, held
    assert [send(run)[:2] for _ in range(4)] == [(200, reference)] * 4
    run.check_exits()  # nobody died


def test_a_transfer_slower_than_its_timeout(start: Callable[..., Run]) -> None:
    """Every second room is held past decode's transfer timeout."""
    run = start(faults=[{"name": "delay-transfer", "every": 2, "seconds": 7}])
    results = [send(run) for _ in range(4)]
    assert [r[0] == 200 for r in results] == [True, False, True, False], results
    reference = results[0][1]
    assert results[2][1] == reference
    for _, message, elapsed in results[1::2]:
        assert f"decode {run.state('decode-0').url} failed" in str(message), message
        assert elapsed < TIMEOUTS["bootstrap_s"] + TIMEOUTS["transfer_s"] + 8, elapsed
    ok, held, _ = run.pools_back(timeout=30)
    assert ok, held
    run.check_exits()


def test_the_router_killed(start: Callable[..., Run]) -> None:
    run = start()
    reference = send(run)[1]
    os.killpg(pgid_of(run, "router"), signal.SIGKILL)
    status, message, elapsed = send(run, timeout=10)
    assert status == 0 and "Connect" in str(message) and elapsed < 10  # refused, not hung
    for name in ("prefill-0", "decode-0"):
        assert httpx.get(f"{run.state(name).url}/health", timeout=5).status_code == 200
    ok, held, _ = run.pools_back()
    assert ok, held
    assert reference
    assert_death_reported(run, "router", "router")
