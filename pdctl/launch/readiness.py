"""Layered readiness of a run: the engines' probes, then a canary through the router.

Per process: `starting` (spawned) -> `alive` (still running) -> `healthy` and
`ready` as its engine's probes answer (`pdctl.engines.probes`: pdctl's servers and
SGLang's each on their own endpoints). Once every process is ready, a 1-token
request through the router must come back: the proof that the run serves PD. A
process that exits at any point fails the run at once, with its log tail; so does
the start-up timeout, naming what was not ready. This module owns the waiting,
nothing of how processes start or stop (`run.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from pdctl.engines import get_engine
from pdctl.engines.dialect import AnswerError
from pdctl.engines.probes import Probe
from pdctl.launch.stages import REFERENCE_ROLE, LaunchFailed, ProcessState

if TYPE_CHECKING:
    from pdctl.launch.run import Run


def wait_ready(run: Run, timeout: float | None, on_change: Callable[[Run], None] | None) -> None:
    """Block until `run` serves; raise LaunchFailed (the run is then stopped)."""
    limit = timeout if timeout is not None else run.plan.topology.launcher.startup_timeout_s
    deadline = time.monotonic() + limit
    with httpx.Client(timeout=2.0) as client:
        while True:
            changed = poll(run, client)
            if changed and on_change is not None:
                on_change(run)
            if all(s.stage == "ready" for s in awaited(run)):
                canary(run, deadline)
                run.check_listeners()
                if on_change is not None:
                    on_change(run)
                return
            if time.monotonic() > deadline:
                waiting = [s for s in awaited(run) if s.stage != "ready"]
                report = "\n\n".join(run.describe(s) for s in waiting)
                names = ", ".join(f"{s.plan.name} ({s.stage})" for s in waiting)
                run.stop()
                raise LaunchFailed(f"not ready within {limit:g} s: {names}", report)
            time.sleep(0.1)


def awaited(run: Run) -> list[ProcessState]:
    """The run's processes its readiness waits for: all but a reference server spawned
    with it (`reference.StartingReference` waits for that one)."""
    return [s for s in run.states if s.plan.role != REFERENCE_ROLE]


def poll(run: Run, client: httpx.Client) -> bool:
    """One round of probes over the processes not ready yet; whether a stage moved."""
    run.check_exits()
    changed = False
    for state in awaited(run):
        if state.stage == "ready":
            continue
        changed |= state.advance("alive")
        for probe in state.plan.probes:
            problem = check(run, client, probe)
            if problem is not None:
                state.detail = problem
                break
            changed |= state.advance(probe.stage)
        else:
            changed |= state.advance("ready")
    return changed


def check(
    run: Run, client: httpx.Client, probe: Probe, ports: dict[str, int] | None = None
) -> str | None:
    """None when the probe's endpoint answers as it should, else what it answered.
    `ports` adds listeners the run's own table lacks (its reference server's)."""
    headers = {"authorization": f"Bearer {run.secret}"} if probe.auth else {}
    try:
        response = client.get(probe.url({**run.render_map, **(ports or {})}), headers=headers)
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


def canary(run: Run, deadline: float) -> None:
    """A 1-token request through the router: the proof that the run serves."""
    router: ProcessState = run.state("router")
    dialect = get_engine(run.plan.topology.engine).dialect
    path, request = dialect.canary()
    problem = ""
    while True:
        run.check_exits()
        started = time.monotonic()
        try:
            response = httpx.post(f"{run.router_url}{path}", json=request, timeout=30)
            if response.status_code == 200:
                answer = dialect.read(response.json())
                run.canary = {
                    "ms": round((time.monotonic() - started) * 1e3, 1),
                    "output_ids": answer.output_ids,
                    "kv_transfer": answer.kv_transfer and answer.kv_transfer.to_json(),
                }
                return
            problem = f"canary request answered {response.status_code}: {response.text[:300]}"
        except (AnswerError, ValueError) as exc:
            problem = f"canary answer unreadable: {exc}: {response.text[:300]}"
        except httpx.HTTPError as exc:
            problem = f"canary request failed: {type(exc).__name__}: {exc}"
        router.detail = problem
        if time.monotonic() > deadline:
            report = "\n\n".join(run.describe(s) for s in run.states)
            run.stop()
            raise LaunchFailed(problem, report)
        time.sleep(0.25)
