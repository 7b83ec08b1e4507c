"""Servers forked from a run's forkserver: owned as spawned ones are, spawned where forking
would differ, their exits reported, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdctl.launch import forking
from pdctl.launch.forking import ForkedProcess, Starter, import_env
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.processes import group_alive, pid_alive
from pdctl.launch.run import Run

SERVE = [sys.executable, "-m", "pdctl.serve"]
# a router in front of nothing: it serves until it is ended (port 0: any free one)
ROUTER = [*SERVE, "--role", "router", "--topology-name", "forking-test", "--prefill",
          "http://127.0.0.1:9", "9", "--decode", "http://127.0.0.1:9", "--host", "127.0.0.1",
          "--port", "0"]  # fmt: skip


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PDCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("PDCTL_FORKSERVER", raising=False)
    yield


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()


def test_a_cpu_run_forks_its_servers_from_one_process(
    make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    run = Run(make_plan(load_checked(make_topology())), tmp_path / "run")
    with run.serving():
        server = run.starter.server
        assert server is not None
        forkserver = server.process.pid
        for state in run.states:
            assert state.spawned is not None
            pid = state.spawned.pid
            fields = _stat(pid)
            assert isinstance(state.spawned.process, ForkedProcess), state.plan.name
            assert int(fields[1]) == forkserver  # its parent
            assert int(fields[2]) == pid and int(fields[3]) == pid  # its own group, session
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                assert handle.read().startswith(f"pdctl:{run.plan.topology.name}:".encode())
        # each server had its request's environment: decode's rank 1 (forked by decode's
        # rank 0) writes the log its PDCTL_LOG_DIR and PDCTL_PROCESS_NAME name
        logs = sorted(p.name for p in run.dir.glob("*.log"))
        assert logs == [
            "decode-0-tp0.log", "decode-0-tp1.log", "forkserver.log", "prefill-0-tp0.log",
            "router-tp0.log",
        ]  # fmt: skip
        assert not run.warnings
        run.start_reference()  # the reference joins the run, forked as its servers are
        reference = run.state("reference").spawned
        assert reference is not None and isinstance(reference.process, ForkedProcess)
        recorded = run.to_json()["forkserver"]
        assert recorded is not None and recorded["pid"] == forkserver
        pgids = [s.spawned.pid for s in run.states if s.spawned]
    assert not any(group_alive(pgid) for pgid in pgids)
    assert not pid_alive(forkserver)
    assert run.starter.server is None
    assert (run.dir / "forkserver.log").read_text() == ""


def test_exits_are_reported_and_a_different_import_environment_is_spawned(
    tmp_path: Path,
) -> None:
    starter = Starter("forking-test", tmp_path, forks=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        bad = starter.spawn("bad", [*SERVE, "--role", "nonsense"], env, tmp_path / "bad.log")
        assert isinstance(bad.process, ForkedProcess)
        assert bad.process.wait(30) == 2  # argparse's refusal, as a spawned server gives
        assert "invalid choice: 'nonsense'" in (tmp_path / "bad.log").read_text()
        assert bad.exit_description() == "exited with 2"

        late = {**env, "PDCTL_PROCESS_NAME": "late", "MC_ANYTHING": "1"}
        assert import_env(late) == import_env(env)
        held = starter.spawn("held", ROUTER, late, tmp_path / "held.log")
        assert isinstance(held.process, ForkedProcess)
        assert held.process.poll() is None
        os.killpg(held.pid, signal.SIGKILL)
        assert held.process.wait(30) == -signal.SIGKILL
        assert held.exit_description() == "killed by SIGKILL"

        other = {**env, "PDCTL_NATIVE_ATTENTION": "0"}  # read when the model's module loads
        spawned = starter.spawn("other", [*SERVE, "--role", "nonsense"], other, tmp_path / "o.log")
        assert isinstance(spawned.process, subprocess.Popen)
        assert spawned.process.wait(60) == 2
        forkserver = starter.server.process.pid if starter.server else None
    finally:
        starter.close()
    assert forkserver is not None and not pid_alive(forkserver)


def test_without_the_forkserver_every_process_is_spawned(
    make_topology: Callable[..., Path], tmp_path: Path
) -> None:
    plan = make_plan(load_checked(make_topology()))
    run = Run(plan, tmp_path / "run", parent_env={**os.environ, "PDCTL_FORKSERVER": "0"})
    assert not run.starter.forks
    detached = Run(plan, tmp_path / "detached", detach=True)  # outlives pdctl: no forkserver
    assert not detached.starter.forks


def test_a_forkserver_that_dies_takes_its_servers_with_it(tmp_path: Path) -> None:
    starter = Starter("forking-test", tmp_path, forks=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        held = starter.spawn("held", ROUTER, env, tmp_path / "held.log")
        assert starter.server is not None
        os.kill(starter.server.process.pid, signal.SIGKILL)
        assert held.process.wait(30) == -signal.SIGKILL  # reported, as its parent is gone
        deadline = time.monotonic() + 15
        while pid_alive(held.pid):  # the parent-death signal ended it
            assert time.monotonic() < deadline, "the forked server outlived its forkserver"
            time.sleep(0.05)
    finally:
        starter.close()


def test_a_forkserver_that_cannot_start_leaves_the_servers_spawned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forkserver that dies before it is ready (here: one that exits at once) costs
    nothing but the fork: the server is spawned, and the run's warning says why."""
    real = forking.spawn_control

    def dying(argv: list[str], env: object, stderr: object) -> object:
        return real([sys.executable, "-c", "import sys; sys.exit(3)"], env, stderr)  # type: ignore[arg-type]

    monkeypatch.setattr(forking, "spawn_control", dying)
    starter = Starter("forking-test", tmp_path, forks=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        bad = starter.spawn("bad", [*SERVE, "--role", "nonsense"], env, tmp_path / "bad.log")
        assert isinstance(bad.process, subprocess.Popen)
        assert bad.process.wait(60) == 2
        assert starter.warning is not None and "exited while importing" in starter.warning
        assert str(tmp_path / "forkserver.log") in starter.warning
        assert not starter.forks  # given up for the rest of the run
    finally:
        starter.close()
