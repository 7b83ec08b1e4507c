"""The colocated reference server of a run: the same engine and model, no PD.

verify compares PD with it (the reference pass) and reproduces divergences on it
with no KV transfer at all (the control before blame). The engine says what the
server is (`Engine.reference`: its ports, command and probes); this module starts it
on this host with the run's environment and hands it to the run as one more process,
so it is stopped with the run (by the run's owner, also when it fails to start), and
waits for it.
Engine faults (perturb-prefix-hit) reach it as they reach the engine's PD servers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from pdctl.engines import get_engine
from pdctl.engines.command import render_command
from pdctl.launch.hosts import LocalHost
from pdctl.launch.plan import LaunchPlan, ProcessPlan
from pdctl.launch.ports import Allocation, allocate
from pdctl.launch.readiness import check
from pdctl.launch.stages import REFERENCE_ROLE, LaunchFailed, ProcessState
from pdctl.settings import FAULTS_VAR
from pdctl.topology.resolve import faults_of


class Joined(Protocol):
    """What the reference takes of the run it joins (`run.Run`); it records nothing there:
    the run adds the state `spawn_reference` returns to its processes."""

    plan: LaunchPlan
    dir: Path
    secret: str

    @property
    def host(self) -> str: ...

    @property
    def local(self) -> LocalHost: ...

    @property
    def render_map(self) -> dict[str, int | str]: ...

    def env_for(
        self, process: ProcessPlan, ports: Mapping[str, int] | None = None
    ) -> dict[str, str]: ...

    def describe(self, state: ProcessState) -> str: ...


@dataclass
class StartingReference:
    """A reference server spawned and not yet ready: `wait` for its URL (from any
    thread; the spawn itself happened on the caller's, whose exit the child watches)."""

    run: Joined
    state: ProcessState
    ports: Allocation

    def wait(self, timeout: float | None = None) -> str:
        """Until the reference answers: within `timeout`, else the topology's start-up
        bound (`launcher.startup_timeout_s`, the one every process of the run has)."""
        limit = (
            timeout if timeout is not None else self.run.plan.topology.launcher.startup_timeout_s
        )
        try:
            _wait(self.run, self.state, self.ports.ports, limit)
        finally:
            self.ports.release()
        return self.state.url


def spawn_reference(run: Joined, tp: int = 1) -> StartingReference:
    """Spawn the reference next to `run`'s processes; `wait` says when its probes answer."""
    topology = run.plan.topology
    engine = get_engine(topology.engine)
    spec = engine.reference(topology, tp)
    ports = allocate(list(spec.slots), run.host)
    plan = ProcessPlan(
        name="reference",
        role=REFERENCE_ROLE,
        replica=0,
        ranks=(),  # its TP ranks are its own
        ports=spec.slots,
        env=spec.env,
        command=spec.command,
        probes=spec.probes,
        workdir=engine.workdir,
        cores=spec.cores,
    )
    state = ProcessState(plan, f"http://{run.host}:{ports.ports['reference.http']}")
    env = run.env_for(plan, ports.ports)
    faults = faults_of(topology, "colocated")  # engine faults: the reference has them too
    if faults:
        env[FAULTS_VAR] = json.dumps(faults)
    run.dir.mkdir(parents=True, exist_ok=True)
    argv = render_command(spec.command, ports.ports)
    try:
        state.spawned = run.local.spawn(plan, argv, run.dir / "reference-tp0.log", env)
    except BaseException:
        ports.release()
        raise
    return StartingReference(run, state, ports)


def _wait(run: Joined, state: ProcessState, ports: dict[str, int], timeout: float) -> None:
    """Until the reference's probes answer. Only its own exit is checked, and nothing is
    stopped here: this may run beside the passes on another thread, and the run's owner
    watches (and stops) the run's other processes itself."""
    assert state.spawned is not None
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            how = state.spawned.exit_description()
            if how is not None:
                raise LaunchFailed(
                    f"the reference server (pid {state.spawned.pid}) {how}", run.describe(state)
                )
            values = {**run.render_map, **ports}
            problems = [check(client, p, values, run.secret) for p in state.plan.probes]
            if not any(problems):
                state.advance("ready")
                return
            state.detail = next(p for p in problems if p)
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"the reference server was not ready within {timeout:g} s ({state.detail})",
                    run.describe(state),
                )
            time.sleep(0.1)
