"""One run of a topology: allocate ports, spawn every process, wait until it really serves.

Readiness is layered, per process: `starting` (spawned) -> `alive` (still running)
-> `healthy` (its /health answers 200) -> `ready` (prefill: its bootstrap endpoint
answers; decode: it reports its KV pool; router: it reports a healthy prefill and
decode). The run is ready once every process is, and a 1-token canary request
through the router came back. A process that exits at any point fails the run at
once with its role, exit status and log tail; so does the start-up timeout, naming
what was not ready. `stop` ends every process group this run started, and checks
that nothing of it is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdctl.engines.base import render_command
from pdctl.errors import LaunchError
from pdctl.launch import state as run_state
from pdctl.launch.listeners import Listener, listeners
from pdctl.launch.loopback import confine, is_loopback
from pdctl.launch.plan import LaunchPlan, ProcessPlan
from pdctl.launch.ports import Allocation, allocate
from pdctl.launch.processes import Spawned, spawn, start_time, stop_groups
from pdctl.topology.resolve import FAULTS_VAR, RUN_ID_VAR, RUN_SECRET_VAR, faults_of

STAGES = ("starting", "alive", "healthy", "ready")
CANARY = {"text": "pdctl canary", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


class LaunchFailed(LaunchError):
    """The run could not come up; `report` says which process and why (with its log)."""

    def __init__(self, message: str, report: str = "") -> None:
        super().__init__(message + (f"\n{report}" if report else ""))
        self.summary = message
        self.report = report


@dataclass
class ProcessState:
    plan: ProcessPlan
    url: str
    spawned: Spawned | None = None
    stage: str = "starting"
    since: float = field(default_factory=time.monotonic)
    detail: str = ""

    def advance(self, stage: str, detail: str = "") -> bool:
        self.detail = detail
        if STAGES.index(stage) > STAGES.index(self.stage):
            self.stage, self.since = stage, time.monotonic()
            return True
        return False


def run_name(plan: LaunchPlan) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{plan.topology.name}-{secrets.token_hex(2)}"


class Run:
    def __new__(cls, plan: LaunchPlan, *args: Any, **kwargs: Any) -> Run:
        if cls is Run and plan.topology.launcher.kind == "ray":
            from pdctl.launch.ray_run import RayRun

            return super().__new__(RayRun)
        return super().__new__(cls)

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

    def env_overrides(self, process: ProcessPlan) -> dict[str, str]:
        """What the process's environment changes of its parent's: topology and run."""
        env = {entry.name: entry.value for entry in process.env}
        env[RUN_ID_VAR] = self.run_id
        env[RUN_SECRET_VAR] = self.secret  # never on a command line
        env["PDCTL_LOG_DIR"] = str(self.dir)
        env["PDCTL_PROCESS_NAME"] = process.name
        return env

    def env_for(self, process: ProcessPlan) -> dict[str, str]:
        env = {**self.parent_env, **self.env_overrides(process)}
        env.setdefault("PYTHONUNBUFFERED", "1")
        warning = confine(env, self.host)
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
        """Allocate ports and spawn every process (servers first, the router last)."""
        slots = [slot for process in self.plan.processes for slot in process.ports]
        self.allocation = allocate(slots, self.host)
        self.dir.mkdir(parents=True, exist_ok=True)
        for process in self.plan.processes:
            port = self.ports[f"{process.name}.http"]
            self.states.append(ProcessState(process, f"http://{self.host}:{port}"))
        try:
            for state in self.states:
                argv = render_command(state.plan.command, self.ports)
                state.spawned = spawn(
                    state.plan.name,
                    argv,
                    self.env_for(state.plan),
                    self.dir / f"{state.plan.name}-tp0.log",
                    die_with_parent=not self.detach,
                )
        except OSError as exc:
            self.stop()
            raise LaunchFailed(f"could not start {state.plan.name}: {exc}") from None
        self.write_state()

    def wait_ready(
        self, timeout: float | None = None, on_change: Callable[[Run], None] | None = None
    ) -> None:
        """Block until the run serves; raise LaunchFailed (the run is then stopped)."""
        limit = timeout if timeout is not None else self.plan.topology.launcher.startup_timeout_s
        deadline = time.monotonic() + limit
        client = httpx.Client(timeout=2.0)
        try:
            while True:
                changed = self._poll(client)
                if changed and on_change is not None:
                    on_change(self)
                if all(s.stage == "ready" for s in self.states):
                    self._canary(deadline)
                    self._check_listeners()
                    if on_change is not None:
                        on_change(self)
                    break
                if time.monotonic() > deadline:
                    waiting = [s for s in self.states if s.stage != "ready"]
                    report = "\n\n".join(self._describe(s) for s in waiting)
                    names = ", ".join(f"{s.plan.name} ({s.stage})" for s in waiting)
                    self.stop()
                    raise LaunchFailed(f"not ready within {limit:g} s: {names}", report)
                time.sleep(0.1)
        finally:
            client.close()
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
            s for s in self.states
            if s.plan.role in ("prefill", "decode") and (wanted is None or s.plan.name in wanted)
        ]  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            problems: list[str] = []
            rings: dict[str, Any] = {}
            for state in servers:
                try:
                    info = httpx.get(f"{state.url}/get_server_info", timeout=10).json()
                except (httpx.HTTPError, ValueError) as exc:
                    problems.append(f"{state.plan.name}: /get_server_info: {exc}")
                    continue
                kv = info["kv"]
                held = kv["total_pages"] - kv["free_pages"] - kv["cached_pages"]
                if held:
                    problems.append(f"{state.plan.name}: {held} KV pages held")
                if info.get("running_requests") or info.get("waiting_requests"):
                    problems.append(f"{state.plan.name}: requests still running")
                ring = info.get("staging_ring")
                if ring is not None:
                    rings[state.plan.name] = ring
                    if not ring["empty"]:
                        problems.append(
                            f"{state.plan.name}: {ring['live_regions']} ring regions live"
                        )
                if info.get("open_rooms"):
                    problems.append(f"{state.plan.name}: {info['open_rooms']} rooms open")
            if not problems or time.monotonic() > deadline:
                return not problems, problems, rings
            time.sleep(0.2)

    def listeners(self) -> dict[str, list[Listener]]:
        """Each process's listening TCP sockets (every rank of its process group)."""
        return {s.plan.name: listeners(s.spawned.pid) for s in self.states if s.spawned}

    def _check_listeners(self) -> None:
        for name, found in self.listeners().items():
            if not is_loopback(self.host_of(name)):
                continue
            exposed = [str(x) for x in found if not x.loopback]
            if exposed:
                self.warnings.append(
                    f"{name} listens beyond loopback on {', '.join(exposed)} "
                    f"although its host is {self.host_of(name)}"
                )

    def _describe(self, state: ProcessState) -> str:
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
                report = self._describe(state)
                self.stop()
                raise LaunchFailed(
                    f"{state.plan.name} ({state.plan.role}, pid {state.spawned.pid}) {how}",
                    report,
                )

    def _poll(self, client: httpx.Client) -> bool:
        self.check_exits()
        changed = False
        for state in self.states:
            if state.stage == "ready":
                continue
            changed |= state.advance("alive")
            try:
                response = client.get(f"{state.url}/health")
            except httpx.HTTPError as exc:
                state.detail = f"/health: {type(exc).__name__}"
                continue
            if response.status_code != 200:
                state.detail = f"/health answered {response.status_code}"
                continue
            changed |= state.advance("healthy")
            problem = self._role_ready(client, state)
            if problem is None:
                changed |= state.advance("ready")
            else:
                state.detail = problem
        return changed

    def _role_ready(self, client: httpx.Client, state: ProcessState) -> str | None:
        """None when the role can do its part of a PD request, else what it lacks."""
        role = state.plan.role
        auth = {"authorization": f"Bearer {self.secret}"}
        try:
            if role == "prefill" and f"{state.plan.name}.bootstrap" in self.ports:
                port = self.ports[f"{state.plan.name}.bootstrap"]
                host = self.host_of(state.plan.name)
                response = client.get(f"http://{host}:{port}/bootstrap/info", headers=auth)
                if response.status_code != 200:
                    return f"bootstrap endpoint answered {response.status_code}"
            elif role in ("decode", "encoder", "colocated"):
                response = client.get(f"{state.url}/get_server_info")
                if response.status_code != 200:
                    return f"/get_server_info answered {response.status_code}"
            elif role == "router" and self.plan.topology.router.kind == "builtin":
                info = client.get(f"{state.url}/get_server_info").json()
                if not info.get("ready"):
                    return "no healthy prefill and decode worker yet"
        except (httpx.HTTPError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _canary(self, deadline: float) -> None:
        """A 1-token request through the router: the proof that the run serves."""
        router = self.state("router")
        problem = ""
        while True:
            self.check_exits()
            started = time.monotonic()
            try:
                response = httpx.post(f"{self.router_url}/generate", json=CANARY, timeout=30)
                if response.status_code == 200:
                    body = response.json()
                    self.canary = {
                        "ms": round((time.monotonic() - started) * 1e3, 1),
                        "output_ids": body.get("output_ids"),
                        "kv_transfer": body.get("meta_info", {}).get("kv_transfer"),
                    }
                    return
                problem = f"canary request answered {response.status_code}: {response.text[:300]}"
            except httpx.HTTPError as exc:
                problem = f"canary request failed: {type(exc).__name__}: {exc}"
            router.detail = problem
            if time.monotonic() > deadline:
                report = "\n\n".join(self._describe(s) for s in self.states)
                self.stop()
                raise LaunchFailed(problem, report)
            time.sleep(0.25)

    def start_reference(self, tp: int = 1, timeout: float = 120.0) -> str:
        """A colocated server of the same model (embedded engine), healthy; its URL."""
        from pdctl.engines.base import PortSlot
        from pdctl.engines.embedded import reference_command

        slots = [PortSlot("reference", "http", "colocated reference server")]
        if tp > 1:
            slots.append(PortSlot("reference", "dist", "reference rendezvous"))
        ports = allocate(slots, self.host)
        argv = reference_command(
            self.plan.topology, ports.ports["reference.http"], ports.ports.get("reference.dist"), tp
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        plan = ProcessPlan("reference", "colocated", 0, (), tuple(slots), (), ())
        state = ProcessState(plan, f"http://{self.host}:{ports.ports['reference.http']}")
        env = {**self.parent_env, "PDCTL_LOG_DIR": str(self.dir), "PDCTL_PROCESS_NAME": "reference"}
        faults = faults_of(self.plan.topology, "colocated")  # engine faults: the reference too
        if faults:
            env[FAULTS_VAR] = json.dumps(faults)
        confine(env, self.host)
        state.spawned = spawn(
            "reference", argv, env, self.dir / "reference-tp0.log", die_with_parent=not self.detach
        )
        self.states.append(state)
        deadline = time.monotonic() + timeout
        while True:
            self.check_exits()
            try:
                if httpx.get(f"{state.url}/health", timeout=2).status_code == 200:
                    state.advance("ready")
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                report = self._describe(state)
                self.stop()
                raise LaunchFailed(
                    f"the reference server was not healthy within {timeout:g} s", report
                )
            time.sleep(0.1)
        ports.release()
        return state.url

    # -- stop ------------------------------------------------------------------------
    def stop(self, grace: float = 5.0) -> list[str]:
        """End every process group of this run (router first); names of any left alive."""
        spawned = [s.spawned for s in reversed(self.states) if s.spawned is not None]
        left = stop_groups([p.pid for p in spawned], grace, [p.process for p in spawned])
        if self.allocation is not None:
            self.allocation.release()
        if self.state_path is not None and not left:
            with contextlib.suppress(FileNotFoundError):
                self.state_path.unlink()
        return [p.name for p in spawned if p.pid in left]
