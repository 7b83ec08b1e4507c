"""The launcher core with real processes: ports, readiness layers, fail-fast, teardown."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdctl.engines.command import PortSlot
from pdctl.launch import ports
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.ports import PortError, allocate
from pdctl.launch.processes import group_alive
from pdctl.launch.run import LaunchFailed, Run


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PDCTL_STATE_DIR", str(tmp_path / "state"))
    yield


def run_of(path: Path, tmp_path: Path) -> Run:
    return Run(make_plan(load_checked(path)), tmp_path / "run")


def test_default_topology_serves_then_leaves_nothing(
    make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    run = run_of(make_topology(), tmp_path)
    run.start()
    try:
        run.wait_ready(timeout=120)
        assert [s.stage for s in run.states] == ["ready"] * 3
        assert run.canary is not None and len(run.canary["output_ids"]) == 1
        assert run.canary["kv_transfer"]["digest_ok"] is True
        logs = sorted(p.name for p in run.dir.glob("*.log"))
        assert logs == [
            "decode-0-tp0.log",
            "decode-0-tp1.log",
            "forkserver.log",  # the servers are forked from it (tests/launch/test_forking.py)
            "prefill-0-tp0.log",
            "router-tp0.log",
        ]
        assert (run.dir / "run.json").exists()
        pgids = [s.spawned.pid for s in run.states if s.spawned]
    finally:
        left = run.stop()
    assert left == []
    assert not any(group_alive(pgid) for pgid in pgids)
    # a stop is not a death: decode's rank 1 ending with the group's SIGTERM is no error,
    # and the servers end without a second signal's forced exit (a lifespan traceback)
    for log in run.dir.glob("*.log"):
        text = log.read_text()
        assert "ERROR" not in text and "Traceback" not in text, (log.name, text[-2000:])


def test_a_role_that_crashes_at_startup_fails_fast_with_its_log(
    make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    # an engine flag the server does not know: decode exits at once with argparse's message
    path = make_topology(roles={"decode": {"tp": 1, "args": ["--no-such-flag"]}})
    run = run_of(path, tmp_path)
    run.start()
    with pytest.raises(LaunchFailed) as failure:
        run.wait_ready(timeout=60)
    assert failure.value.summary.startswith("decode-0 (decode, pid ")
    assert "exited with 2" in failure.value.summary
    assert "unrecognized arguments: --no-such-flag" in failure.value.report
    assert not any(group_alive(s.spawned.pid) for s in run.states if s.spawned)


def test_a_taken_fixed_port_is_named(make_topology: Callable[..., Path]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        plan = make_plan(load_checked(make_topology(router={"kind": "builtin", "port": port})))
        slots = [slot for process in plan.processes for slot in process.ports]
        with pytest.raises(PortError, match=rf"port {port} \(router HTTP API.*is already in use"):
            allocate(slots, "127.0.0.1")


def test_concurrent_allocations_never_share_a_port() -> None:
    slots = [PortSlot("p", f"s{i}", "test") for i in range(20)]
    first = allocate(slots, "127.0.0.1")
    second = allocate(slots, "127.0.0.1")  # before anything binds the first run's ports
    assert len(set(first.ports.values())) == 20
    assert not set(first.ports.values()) & set(second.ports.values())
    first.release()
    second.release()


ALLOCATE = """
import json, sys
from pdctl.engines.command import PortSlot
from pdctl.launch.ports import allocate
got = allocate([PortSlot("p", f"s{i}", "test") for i in range(40)], "127.0.0.1")
print(json.dumps(sorted(got.ports.values())), flush=True)
sys.stdin.read()  # alive until told: a dead holder's reservations lapse, as they should
"""


def test_pdctl_processes_allocating_at_once_never_share_a_port(tmp_path: Path) -> None:
    """Six live processes allocate 40 ports each at the same moment, none binding them:
    the host lock and the reservation table keep every port distinct. (Each stays alive
    until all have allocated: reservations of a process that died are free again.)"""
    env = {**os.environ, "PDCTL_PORTS_DIR": str(tmp_path / "ports")}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", ALLOCATE],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    seen: list[int] = []
    try:
        for child in children:
            assert child.stdout is not None
            seen += json.loads(child.stdout.readline())
    finally:
        for child in children:
            child.communicate(timeout=120)  # closes stdin: the child ends
    assert all(child.returncode == 0 for child in children)
    assert len(seen) == 240 and len(set(seen)) == 240


def test_dynamic_ports_stay_out_of_the_ephemeral_range() -> None:
    """Outgoing connections take ephemeral ports; a server's port must never be one."""
    low, high = ports.ephemeral_range()
    slots = [PortSlot("p", f"s{i}", "test") for i in range(50)]
    allocation = allocate(slots, "127.0.0.1")
    try:
        assert all(not low <= port <= high for port in allocation.ports.values())
        assert all(port >= ports.LOWEST_PORT for port in allocation.ports.values())
    finally:
        allocation.release()


def test_the_kernels_ranges_are_read_and_respected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ip_local_port_range").write_text("30000\t65000\n")
    (tmp_path / "ip_local_reserved_ports").write_text("20000-29000,29500\n")
    monkeypatch.setattr(ports, "_PROC", tmp_path)
    candidates = ports.candidate_ports()
    assert candidates == [p for p in range(29001, 30000) if p != 29500] + list(range(65001, 65536))
    allocation = allocate([PortSlot("p", f"s{i}", "test") for i in range(10)], "127.0.0.1")
    assert set(allocation.ports.values()) <= set(candidates)
    allocation.release()
    # a host tuned to an ephemeral range over nearly everything: the kernel picks
    (tmp_path / "ip_local_port_range").write_text("1024 65535\n")
    assert ports.candidate_ports() == []
    allocation = allocate([PortSlot("p", f"s{i}", "test") for i in range(10)], "127.0.0.1")
    assert len(set(allocation.ports.values())) == 10 and 0 not in allocation.ports.values()
    allocation.release()


@given(st.lists(st.tuples(st.integers(0, 65535), st.integers(0, 65535)), max_size=6))
def test_reserved_port_lists_parse(pairs: list[tuple[int, int]]) -> None:
    text = ",".join(f"{a}-{b}" if a != b else str(a) for a, b in pairs)
    assert ports._parse_ranges(text + "\n") == [(a, b) for a, b in pairs]
    assert ports._parse_ranges("junk,-,1-x") == []
