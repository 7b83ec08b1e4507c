"""One run of a topology on this host: allocate ports, spawn every process, stop them.

`start` allocates every listener and spawns the processes (servers first, the router
last), each in its own process group with its own log; `wait_ready` runs the layered
readiness of `readiness.py` (the engines' probes, then a canary through the router);
`start_reference` adds the colocated reference server (`reference.py`); `stop` ends
every process group this run started and checks that nothing of it is left. Where
processes start is a plug point (`launcher.py`): this class is the local launcher,
`ray_run.RayRun` the Ray one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from pdctl.engines.command import render_command, render_value
from pdctl.launch import state as run_state
from pdctl.launch.forking import Starter, forks_by_default
from pdctl.launch.listeners import Listener, listeners
from pdctl.launch.loopback import confine, is_loopback
from pdctl.launch.plan import LaunchPlan, ProcessPlan
from pdctl.launch.ports import Allocation, allocate
from pdctl.launch.preparation import make_workdir, prepare
from pdctl.launch.processes import start_time, stop_groups
from pdctl.launch.readiness import wait_ready
from pdctl.launch.reference import StartingReference, spawn_reference
from pdctl.launch.settings import LaunchSettings
from pdctl.launch.stages import STAGES, LaunchFailed, ProcessState
from pdctl.records import ServerInfo
from pdctl.settings import LOG_DIR_VAR, PROCESS_NAME_VAR, RUN_ID_VAR, RUN_SECRET_VAR

__all__ = ["STAGES", "LaunchFailed", "ProcessState", "Run", "run_name"]


def run_name(plan: LaunchPlan) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{plan.topology.name}-{secrets.token_hex(2)}"


class Run:
    """A run on this host (the local launcher)."""

    def __init__(
        self,
        plan: LaunchPlan,
        run_dir: Path | None = None,
        *,
        detach: bool = False,
        parent_env: Mapping[str, str] | None = None,
    ) -> None:
        self.plan = plan
        topology = plan.topology
        self.name = run_name(plan)
        base = Path(topology.launcher.run_dir)
        if not base.is_absolute():
            base = Path.cwd() / base
        self.dir = run_dir or base / self.name
        self.detach = detach
        self.parent_env = dict(os.environ if parent_env is None else parent_env)
        self.secret = secrets.token_hex(16)
        self.run_id = self.name
        self.allocation: Allocation | None = None
        self.states: list[ProcessState] = []
        self.canary: dict[str, Any] | None = None
        self.started_at = time.time()
        self.state_path: Path | None = None
        self.warnings: list[str] = []  # what the run could not do as asked (not fatal)
        self.hosts: dict[str, str] = {}  # process -> its address, where not the topology's host
        # the embedded servers of an attached CPU run are forked from one process that
        # imported them once (`forking`); the rest is spawned
        self.settings = LaunchSettings.from_environ(self.parent_env)
        forks = not detach and forks_by_default(topology.device, self.settings)
        self.starter = Starter(topology.name, self.dir, forks=forks)

    # -- what the run is -------------------------------------------------------------
    @property
    def ports(self) -> dict[str, int]:
        return self.allocation.ports if self.allocation else {}

    @property
    def host(self) -> str:
        return self.plan.topology.host

    def host_of(self, name: str) -> str:
        return self.hosts.get(name, self.host)

    @property
    def render_map(self) -> dict[str, int | str]:
        """What fills a command's placeholders: ports, and hosts where they differ."""
        return {**self.ports, **{f"{name}.host": host for name, host in self.hosts.items()}}

    @property
    def router_url(self) -> str:
        return f"http://{self.host_of('router')}:{self.ports['router.http']}"

    def state(self, name: str) -> ProcessState:
        return next(s for s in self.states if s.plan.name == name)

    def workdir(self, name: str) -> Path:
        """The folder of the run a process of an engine that asks for one works in."""
        return self.dir / name

    def env_overrides(
        self, process: ProcessPlan, ports: Mapping[str, int] | None = None
    ) -> dict[str, str]:
        """What the process's environment changes of its parent's: topology and run (its
        ports, and `ports` it has beyond the run's table, and its folder filled into the
        values that name them)."""
        values = {**self.render_map, **(ports or {}), "workdir": str(self.workdir(process.name))}
        env = {entry.name: render_value(entry.value, values) for entry in process.env}
        env[RUN_ID_VAR] = self.run_id
        env[RUN_SECRET_VAR] = self.secret  # never on a command line
        env[LOG_DIR_VAR] = str(self.dir)
        env[PROCESS_NAME_VAR] = process.name
        return env

    def env_for(
        self, process: ProcessPlan, ports: Mapping[str, int] | None = None
    ) -> dict[str, str]:
        """The whole environment a process of this run starts with (the one builder)."""
        env = {**self.parent_env, **self.env_overrides(process, ports)}
        env.setdefault("PYTHONUNBUFFERED", "1")
        warning = confine(env, self.host, self.settings.loopback_shim)
        if warning and warning not in self.warnings:
            self.warnings.append(warning)
        return env

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "topology": self.plan.topology.name,
            "file": self.plan.loaded.file,
            "run_dir": str(self.dir),
            "started_at": self.started_at,
            "pdctl_pid": os.getpid(),
            "detached": self.detach,
            "router_url": self.router_url if self.ports else None,
            "canary": self.canary,
            "warnings": self.warnings,
            "ports": self.ports,
            "forkserver": self.starter.describe(),
            "processes": [
                {
                    "name": s.plan.name,
                    "role": s.plan.role,
                    "replica": s.plan.replica,
                    "url": s.url,
                    "pid": s.spawned.pid if s.spawned else None,
                    "pgid": s.spawned.pid if s.spawned else None,
                    "start_time": start_time(s.spawned.pid) if s.spawned else None,
                    "titles": [r.title for r in s.plan.ranks],
                    "log": str(s.spawned.log_path) if s.spawned else None,
                    "stage": s.stage,
                    "command": render_command(s.plan.command, self.render_map),
                }
                for s in self.states
            ],
            "plan": self.plan.to_json(self.parent_env),
        }

    def write_state(self) -> Path:
        """run.json in the run directory, and the host-wide record `status` reads."""
        data = self.to_json()
        path = self.dir / "run.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
        self.state_path = run_state.save(data)
        return path

    def watch(self, stop: threading.Event, interval: float = 0.2) -> None:
        """While up: return when `stop` is set; raise LaunchFailed when a process exits."""
        while not stop.wait(interval):
            self.check_exits()

    # -- start -----------------------------------------------------------------------
    @contextlib.contextmanager
    def serving(self) -> Iterator[Run]:
        """Start, wait until the run serves, and stop it on the way out, whatever happened."""
        self.start()
        try:
            self.wait_ready()
            yield self
        finally:
            self.stop()

    def start(self) -> None:
        """Prepare, allocate ports and spawn every process (servers first, the router
        last)."""
        prepare(self.plan.preparations)
        slots = [slot for process in self.plan.processes for slot in process.ports]
        self.allocation = allocate(slots, self.host)
        self.dir.mkdir(parents=True, exist_ok=True)
        for process in self.plan.processes:
            port = self.ports[f"{process.name}.http"]
            self.states.append(ProcessState(process, f"http://{self.host}:{port}"))
        try:
            for state in self.states:
                where = None
                if state.plan.workdir:
                    where = make_workdir(self.workdir(state.plan.name))
                argv = render_command(state.plan.command, self.ports)
                state.spawned = self.starter.spawn(
                    state.plan.name,
                    argv,
                    self.env_for(state.plan),
                    self.dir / f"{state.plan.name}-tp0.log",
                    die_with_parent=not self.detach,
                    cwd=where,
                    cores=state.plan.cores,
                )
        except OSError as exc:
            self.stop()
            raise LaunchFailed(f"could not start {state.plan.name}: {exc}") from None
        if self.starter.warning and self.starter.warning not in self.warnings:
            self.warnings.append(self.starter.warning)
        self.write_state()

    def wait_ready(
        self, timeout: float | None = None, on_change: Callable[[Run], None] | None = None
    ) -> None:
        """Block until the run serves; raise LaunchFailed (the run is then stopped)."""
        changed = None if on_change is None else (lambda: on_change(self))
        try:
            self.canary = wait_ready(self, timeout, changed)
        except LaunchFailed:
            self.stop()
            raise
        self.check_listeners()
        if on_change is not None:
            on_change(self)
        if self.allocation is not None:
            self.allocation.release()
        self.write_state()

    def pools_back(
        self, timeout: float = 30.0, names: Iterable[str] | None = None
    ) -> tuple[bool, list[str], dict[str, Any]]:
        """Wait until every server's KV pool is full (radix cache apart), its staging ring
        empty and no room open; returns (all back, what is still held, the rings' state)."""
        wanted = set(names) if names is not None else None
        servers = [
            s
            for s in self.states
            if s.plan.role in ("prefill", "decode") and (wanted is None or s.plan.name in wanted)
        ]
        deadline = time.monotonic() + timeout
        while True:
            problems: list[str] = []
            rings: dict[str, Any] = {}
            for state in servers:
                try:
                    response = httpx.get(f"{state.url}/get_server_info", timeout=10)
                    info = ServerInfo.from_json(response.json())
                except (httpx.HTTPError, ValueError) as exc:
                    problems.append(f"{state.plan.name}: /get_server_info: {exc}")
                    continue
                problems += [f"{state.plan.name}: {leak}" for leak in info.leaks()]
                if info.staging_ring is not None:
                    rings[state.plan.name] = info.staging_ring.to_json()
            if not problems or time.monotonic() > deadline:
                return not problems, problems, rings
            time.sleep(0.2)

    def listeners(self) -> dict[str, list[Listener]]:
        """Each process's listening TCP sockets (every rank of its process group)."""
        return {s.plan.name: listeners(s.spawned.pid) for s in self.states if s.spawned}

    def check_listeners(self) -> None:
        for name, found in self.listeners().items():
            if not is_loopback(self.host_of(name)):
                continue
            exposed = [str(x) for x in found if not x.loopback]
            if exposed:
                self.warnings.append(
                    f"{name} listens beyond loopback on {', '.join(exposed)} "
                    f"although its host is {self.host_of(name)}"
                )

    def describe(self, state: ProcessState) -> str:
        assert state.spawned is not None
        lines = [f"--- {state.plan.name} ({state.plan.role}), log {state.spawned.log_path}"]
        if state.detail:
            lines.append(f"    last check: {state.detail}")
        tail = state.spawned.log_tail(20)
        lines += [f"    | {line}" for line in tail.splitlines()] or ["    | (empty log)"]
        return "\n".join(lines)

    def check_exits(self) -> None:
        """Raise LaunchFailed naming the first process that exited (the run is stopped)."""
        for state in self.states:
            assert state.spawned is not None
            how = state.spawned.exit_description()
            if how is not None:
                report = self.describe(state)
                self.stop()
                raise LaunchFailed(
                    f"{state.plan.name} ({state.plan.role}, pid {state.spawned.pid}) {how}",
                    report,
                )

    def start_reference(self, tp: int = 1, timeout: float | None = None) -> str:
        """A colocated server of the same engine and model, ready; its URL."""
        return self.spawn_reference(tp).wait(timeout)

    def spawn_reference(self, tp: int = 1) -> StartingReference:
        """The reference spawned now, one more process of this run (stopped with it); its
        `wait` (from any thread) gives the URL when ready."""
        starting = spawn_reference(self, tp)
        self.states.append(starting.state)
        return starting

    # -- stop ------------------------------------------------------------------------
    def stop(self, grace: float = 5.0) -> list[str]:
        """End every process group of this run (router first); names of any left alive."""
        spawned = [s.spawned for s in reversed(self.states) if s.spawned is not None]
        left = stop_groups([p.pid for p in spawned], grace, [p.process for p in spawned])
        self.starter.close()  # after its servers: they die with it
        if self.allocation is not None:
            self.allocation.release()
        if self.state_path is not None and not left:
            with contextlib.suppress(FileNotFoundError):
                self.state_path.unlink()
        return [p.name for p in spawned if p.pid in left]
