"""One run of a topology: reserve ports, start every process, wait until it serves, stop.

`start` reserves every listener and starts the processes (servers first, the router
last), each in its own process group with its own log; `wait_ready` runs the layered
readiness of `readiness.py` (the engines' probes, then a canary through the router);
`start_reference` adds the colocated reference server (`reference.py`); `stop` ends
every process group this run started and checks that nothing of it is left. Where
processes start is the run's host (`hosts.py`, picked by `launcher.kind`): this host,
or the nodes of a Ray cluster; the run, its start loop and its record are the same.
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

import httpx

from pdctl.engines.command import render_command, render_value
from pdctl.launch import state as run_state
from pdctl.launch.forking import Starter, forks_by_default
from pdctl.launch.hosts import Host, LocalHost, Reserved, make_host
from pdctl.launch.listeners import Listener
from pdctl.launch.loopback import is_loopback
from pdctl.launch.plan import LaunchPlan, ProcessPlan
from pdctl.launch.processes import process_env
from pdctl.launch.readiness import wait_ready
from pdctl.launch.reference import StartingReference, spawn_reference
from pdctl.launch.run_record import Canary, ProcessRecord, RunRecord
from pdctl.launch.settings import LaunchSettings
from pdctl.launch.stages import STAGES, LaunchFailed, ProcessState
from pdctl.records import RingState, ServerInfo
from pdctl.settings import LOG_DIR_VAR, PROCESS_NAME_VAR, RUN_ID_VAR, RUN_SECRET_VAR

__all__ = ["STAGES", "LaunchFailed", "ProcessState", "Run", "run_name"]


def run_name(plan: LaunchPlan) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{plan.topology.name}-{secrets.token_hex(2)}"


class Run:
    """A run of a topology, on the host its launcher names."""

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
        self.reserved: Reserved | None = None
        self.states: list[ProcessState] = []
        self.canary: Canary | None = None
        self.started_at = time.time()
        self.state_path: Path | None = None
        self.warnings: list[str] = []  # what the run could not do as asked (not fatal)
        # the embedded servers of an attached CPU run are forked from one process that
        # imported them once (`forking`); the rest is spawned
        self.settings = LaunchSettings.from_environ(self.parent_env)
        forks = not detach and forks_by_default(topology.device, self.settings)
        self.spawner: Host = make_host(self, forks=forks)

    # -- what the run is -------------------------------------------------------------
    @property
    def local(self) -> LocalHost:
        """This host's part of the run (all of it, unless the launcher is Ray)."""
        return self.spawner.local

    @property
    def starter(self) -> Starter:
        return self.local.starter

    @property
    def ports(self) -> dict[str, int]:
        return self.reserved.ports if self.reserved else {}

    @property
    def hosts(self) -> dict[str, str]:
        """Process -> its address, where not the topology's host."""
        return self.reserved.hosts if self.reserved else {}

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
        """The whole environment a process of this run starts with on this host."""
        overrides = self.env_overrides(process, ports)
        env, warning = process_env(
            self.parent_env, overrides, self.host, self.settings.loopback_shim
        )
        self.warn(warning)
        return env

    def warn(self, warning: str | None) -> None:
        """Note what the run could not do as asked (once)."""
        if warning and warning not in self.warnings:
            self.warnings.append(warning)

    def to_json(self) -> dict[str, object]:
        """run.json as it is written (`record`)."""
        return dict(self.record())

    def record(self) -> RunRecord:
        """What this run started, where and how it went (run.json, `pdctl status`)."""
        record: RunRecord = {
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
            "processes": [self.process_record(s) for s in self.states],
            "plan": self.plan.to_json(self.parent_env),
        }
        self.spawner.annotate(record)
        return record

    def process_record(self, state: ProcessState) -> ProcessRecord:
        spawned = state.spawned
        return {
            "name": state.plan.name,
            "role": state.plan.role,
            "replica": state.plan.replica,
            "url": state.url,
            "pid": spawned.pid if spawned else None,
            "pgid": spawned.pid if spawned else None,
            "start_time": self.spawner.start_time(spawned) if spawned else None,
            "titles": [r.title for r in state.plan.ranks],
            "log": str(spawned.log_path) if spawned else None,
            "stage": state.stage,
            "command": render_command(state.plan.command, self.render_map),
        }

    def write_state(self) -> Path:
        """run.json in the run directory, and the host-wide record `status` reads."""
        data = self.record()
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
        """Reserve ports (after the engine's preparations, on this host) and start every
        process (servers first, the router last); whatever fails stops the run."""
        try:
            self.reserved = self.spawner.reserve(self.plan.processes)
            self.dir.mkdir(parents=True, exist_ok=True)
            for process in self.plan.processes:
                port = self.ports[f"{process.name}.http"]
                url = f"http://{self.host_of(process.name)}:{port}"
                self.states.append(ProcessState(process, url))
            for state in self.states:
                self.spawn(state)
        except BaseException:
            self.stop()
            raise
        self.warn(self.starter.warning)
        self.write_state()

    def spawn(self, state: ProcessState) -> None:
        """Start one process of the run on its host."""
        name = state.plan.name
        argv = render_command(state.plan.command, self.render_map)
        try:
            state.spawned = self.spawner.spawn(state.plan, argv, self.dir / f"{name}-tp0.log")
        except OSError as exc:
            raise LaunchFailed(f"could not start {name}: {exc}") from None

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
        self.spawner.release()
        self.write_state()

    def pools_back(
        self, timeout: float = 30.0, names: Iterable[str] | None = None
    ) -> tuple[bool, list[str], dict[str, RingState]]:
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
            rings: dict[str, RingState] = {}
            for state in servers:
                try:
                    response = httpx.get(f"{state.url}/get_server_info", timeout=10)
                    info = ServerInfo.from_json(response.json())
                except (httpx.HTTPError, ValueError) as exc:
                    problems.append(f"{state.plan.name}: /get_server_info: {exc}")
                    continue
                problems += [f"{state.plan.name}: {leak}" for leak in info.leaks()]
                if info.staging_ring is not None:
                    rings[state.plan.name] = info.staging_ring
            if not problems or time.monotonic() > deadline:
                return not problems, problems, rings
            time.sleep(0.2)

    def listeners(self) -> dict[str, list[Listener]]:
        """Each process's listening TCP sockets (every rank of its process group)."""
        return self.spawner.listeners()

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

    def first_exit(self) -> LaunchFailed | None:
        """The failure naming the first process that exited, with its log; None while
        every process runs. Nothing is stopped."""
        for state in self.states:
            assert state.spawned is not None
            how = state.spawned.exit_description()
            if how is not None:
                what = f"{state.plan.name} ({state.plan.role}, pid {state.spawned.pid}) {how}"
                return LaunchFailed(what, self.describe(state))
        return None

    def check_exits(self) -> None:
        """Raise LaunchFailed naming the first process that exited (the run is stopped)."""
        failure = self.first_exit()
        if failure is not None:
            self.stop()
            raise failure

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
        left = self.spawner.stop(grace)
        if self.state_path is not None and not left:
            with contextlib.suppress(FileNotFoundError):
                self.state_path.unlink()
        return left
