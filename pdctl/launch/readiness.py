"""Layered readiness of a run: the engines' probes, then a canary through the router.

Per process: `starting` (spawned) -> `alive` (still running) -> `healthy` and
`ready` as its engine's probes answer (`pdctl.engines.probes`: pdctl's servers and
SGLang's each on their own endpoints). Once every process is ready, a 1-token
request through the router must come back: the proof that the run serves PD. A
process that exits at any point fails the run at once, with its log tail; so does
the start-up timeout, naming what was not ready. This module owns the waiting,
nothing of how processes start or stop: it returns the canary or raises LaunchFailed,
and the run (`run.py`) records what it found and stops itself when it fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import httpx

from pdctl.engines import get_engine
from pdctl.engines.dialect import AnswerError
from pdctl.engines.probes import Probe
from pdctl.launch.plan import LaunchPlan
from pdctl.launch.run_record import Canary
from pdctl.launch.stages import REFERENCE_ROLE, LaunchFailed, ProcessState


class Watched(Protocol):
    """What readiness reads of a run (`run.Run`): it records nothing there and stops
    nothing; a LaunchFailed it raises is the run's to act on."""

    plan: LaunchPlan
    states: list[ProcessState]
    secret: str

    @property
    def render_map(self) -> dict[str, int | str]: ...

    @property
    def router_url(self) -> str: ...

    def describe(self, state: ProcessState) -> str: ...

    def first_exit(self) -> LaunchFailed | None: ...


def check_exits(run: Watched) -> None:
    """Raise the failure naming the first process of `run` that exited, if one did."""
    failure = run.first_exit()
    if failure is not None:
        raise failure


def wait_ready(run: Watched, timeout: float | None, on_change: Callable[[], None] | None) -> Canary:
    """Block until `run` serves; the canary's answer. LaunchFailed when a process exits or
    the time is up (the caller stops the run)."""
    limit = timeout if timeout is not None else run.plan.topology.launcher.startup_timeout_s
    deadline = time.monotonic() + limit
    with httpx.Client(timeout=2.0) as client:
        while True:
            changed = poll(run, client)
            if changed and on_change is not None:
                on_change()
            if all(s.stage == "ready" for s in awaited(run.states)):
                return canary(run, deadline)
            if time.monotonic() > deadline:
                waiting = [s for s in awaited(run.states) if s.stage != "ready"]
                report = "\n\n".join(run.describe(s) for s in waiting)
                names = ", ".join(f"{s.plan.name} ({s.stage})" for s in waiting)
                raise LaunchFailed(f"not ready within {limit:g} s: {names}", report)
            time.sleep(0.1)


def awaited(states: list[ProcessState]) -> list[ProcessState]:
    """The run's processes its readiness waits for: all but a reference server spawned
    with it (`reference.StartingReference` waits for that one)."""
    return [s for s in states if s.plan.role != REFERENCE_ROLE]


def poll(run: Watched, client: httpx.Client) -> bool:
    """One round of probes over the processes not ready yet; whether a stage moved."""
    check_exits(run)
    changed = False
    for state in awaited(run.states):
        if state.stage == "ready":
            continue
        changed |= state.advance("alive")
        for probe in state.plan.probes:
            problem = check(client, probe, run.render_map, run.secret)
            if problem is not None:
                state.detail = problem
                break
            changed |= state.advance(probe.stage)
        else:
            changed |= state.advance("ready")
    return changed


def check(
    client: httpx.Client, probe: Probe, ports: Mapping[str, int | str], secret: str
) -> str | None:
    """None when the probe's endpoint answers as it should, else what it answered."""
    headers = {"authorization": f"Bearer {secret}"} if probe.auth else {}
    try:
        response = client.get(probe.url(ports), headers=headers)
    except httpx.HTTPError as exc:
        return f"{probe.path} ({probe.what}): {type(exc).__name__}"
    if response.status_code != 200:
        return f"{probe.path} ({probe.what}) answered {response.status_code}"
    if probe.ready_field is None:
        return None
    try:
        body: Any = response.json()
    except ValueError:
        return f"{probe.path} ({probe.what}) answered with no JSON"
    if not (isinstance(body, dict) and body.get(probe.ready_field)):
        return f"{probe.path}: not {probe.what} yet"
    return None


def canary(run: Watched, deadline: float) -> Canary:
    """A 1-token request through the router, the proof that the run serves: its time,
    tokens and transfer."""
    router = next(s for s in run.states if s.plan.name == "router")
    dialect = get_engine(run.plan.topology.engine).dialect
    path, request = dialect.canary()
    problem = ""
    while True:
        check_exits(run)
        started = time.monotonic()
        try:
            response = httpx.post(f"{run.router_url}{path}", json=request, timeout=30)
            if response.status_code == 200:
                answer = dialect.read(response.json())
                transfer = answer.kv_transfer
                return {
                    "ms": round((time.monotonic() - started) * 1e3, 1),
                    "output_ids": answer.output_ids,
                    "kv_transfer": None if transfer is None else transfer.to_json(),
                }
            problem = f"canary request answered {response.status_code}: {response.text[:300]}"
        except (AnswerError, ValueError) as exc:
            problem = f"canary answer unreadable: {exc}: {response.text[:300]}"
        except httpx.HTTPError as exc:
            problem = f"canary request failed: {type(exc).__name__}: {exc}"
        router.detail = problem
        if time.monotonic() > deadline:
            raise LaunchFailed(problem, "\n\n".join(run.describe(s) for s in run.states))
        time.sleep(0.25)
