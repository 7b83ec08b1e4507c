"""A LaunchPlan: every process pdctl would start for a topology, resolved but not started.

`load_checked` is how commands get a topology: the file is validated, then the
engine's own rules run (flags it manages, features it lacks). `make_plan` asks the
engine for each server's ports, environment and command line and adds the router.
Ports stay symbolic (`PortRef`) until launch allocates them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdctl.engines import get_engine
from pdctl.engines.base import Engine, Preparation
from pdctl.engines.checkpoint import ModelPath
from pdctl.engines.command import Command, PortSlot, render_command, shell_line
from pdctl.engines.probes import Probe
from pdctl.engines.routers import (
    ROUTER,
    router_command,
    router_issues,
    router_probes,
    router_slots,
)
from pdctl.titles import rank_title
from pdctl.topology import LoadedTopology, TopologyError, load_file
from pdctl.topology.issues import Issue, errors_only
from pdctl.topology.model import Topology
from pdctl.topology.resolve import (
    EnvEntry,
    Requirements,
    ServerLayout,
    base_env,
    requirements,
    servers,
)
from pdctl.topology.rules import model_path


@dataclass(frozen=True)
class RankPlan:
    rank: int
    device: int | None  # physical index; None on cpu
    title: str  # process title: pdctl:<topology>:<role>:tp<rank>


@dataclass(frozen=True)
class ProcessPlan:
    """One process pdctl spawns (its other TP ranks are spawned by the process itself)."""

    name: str
    role: str
    replica: int
    ranks: tuple[RankPlan, ...]
    ports: tuple[PortSlot, ...]
    env: tuple[EnvEntry, ...]
    command: Command
    probes: tuple[Probe, ...] = ()  # readiness, in order (the engine's own endpoints)
    workdir: bool = False  # runs in its own folder of the run (`<workdir>` in its env)
    cores: tuple[int, ...] = ()  # its CPU affinity, inherited by its threads (() = every core)

    def env_values(self) -> dict[str, str]:
        return {entry.name: entry.value for entry in self.env}


@dataclass(frozen=True)
class LaunchPlan:
    loaded: LoadedTopology
    processes: tuple[ProcessPlan, ...]
    requirements: Requirements
    warnings: tuple[Issue, ...]
    preparations: tuple[Preparation, ...] = ()  # run before any server starts
    engine_python: str = ""  # the interpreter that runs the engine's servers

    @property
    def topology(self) -> Topology:
        return self.loaded.topology

    @property
    def router(self) -> ProcessPlan:
        return next(p for p in self.processes if p.role == ROUTER)

    @property
    def fixed_ports(self) -> dict[str, int]:
        """Ports the topology pins; every other port is allocated at launch."""
        return {
            slot.key: slot.fixed
            for process in self.processes
            for slot in process.ports
            if slot.fixed is not None
        }

    @property
    def router_url(self) -> str:
        port = self.router.ports[0].ref.render(self.fixed_ports)
        return f"http://{self.topology.host}:{port}"

    def to_json(self, parent_env: Mapping[str, str] | None = None) -> dict[str, object]:
        parent = os.environ if parent_env is None else parent_env
        return {
            "topology": self.topology.name,
            "file": self.loaded.file,
            "engine": self.topology.engine,
            "engine_python": self.engine_python,
            "device": self.topology.device,
            "deterministic": self.topology.serving.deterministic,
            "router_url": self.router_url,
            "requirements": self.requirements.to_json(),
            "warnings": [issue.to_json() for issue in self.warnings],
            "preparations": [{"what": p.what, "command": list(p.argv)} for p in self.preparations],
            "processes": [
                _process_json(process, parent, self.fixed_ports) for process in self.processes
            ],
        }


def _process_json(
    process: ProcessPlan, parent: Mapping[str, str], ports: Mapping[str, int]
) -> dict[str, object]:
    return {
        "name": process.name,
        "role": process.role,
        "replica": process.replica,
        "ranks": [{"rank": r.rank, "device": r.device, "title": r.title} for r in process.ranks],
        "cores": list(process.cores),
        "ports": [
            {
                "key": slot.key,
                "name": slot.name,
                "purpose": slot.purpose,
                "port": slot.fixed,
                "allocated_at_launch": slot.fixed is None,
            }
            for slot in process.ports
        ],
        "env": [
            {
                "name": entry.name,
                "value": entry.shown(),
                "source": entry.source,
                "overrides": entry.overrides,
                "parent": None if entry.secret else parent.get(entry.name),
                "secret": entry.secret,
            }
            for entry in process.env
        ],
        "command": render_command(process.command, ports),
        "command_line": shell_line(process.command, ports),
        "probes": [probe.describe(ports) for probe in process.probes],
    }


def check_engine(loaded: LoadedTopology) -> LoadedTopology:
    """Run the engine's and router's rules, the model's checkpoint among them; raise
    TopologyError on any error. model.path comes back absolute where it names something
    on this machine (servers start in other folders), as written where it is a hub id
    the engine resolves."""
    topology = loaded.topology
    engine = get_engine(topology.engine)
    model = _model_path(loaded)
    extra = [
        *(engine.model_issues(model) if model is not None else ()),
        *engine.check(topology),
        *router_issues(topology),
    ]
    issues = [loaded.locate(issue) for issue in extra]
    if errors_only(issues):
        raise TopologyError(sorted([*issues, *loaded.warnings], key=lambda i: i.line or 0))
    return LoadedTopology(
        _with_model_path(topology, model, engine),
        loaded.file,
        loaded.source,
        loaded.base_dir,
        (*loaded.warnings, *issues),
    )


def _model_path(loaded: LoadedTopology) -> ModelPath | None:
    local = model_path(loaded.topology, loaded.context)
    written = loaded.topology.model.path
    return None if local is None or written is None else ModelPath(written, local)


def _with_model_path(topology: Topology, model: ModelPath | None, engine: Engine) -> Topology:
    if model is None or str(model.local) == model.written:
        return topology
    if engine.takes_hub_ids and not model.local.exists():
        return topology  # a hub id, as written
    resolved = topology.model.model_copy(update={"path": str(model.local.resolve())})
    return topology.model_copy(update={"model": resolved})


def load_checked(path: str | Path) -> LoadedTopology:
    """The one way commands read a topology: file rules, then engine rules."""
    return check_engine(load_file(path))


def _title(topology: Topology, server: ServerLayout, rank: int) -> str:
    return rank_title(topology.name, server.role, rank, server.replica)


def make_plan(loaded: LoadedTopology) -> LaunchPlan:
    topology = loaded.topology
    engine = get_engine(topology.engine)
    layouts = servers(topology)
    slot_maps = []
    processes: list[ProcessPlan] = []
    for server in layouts:
        slots = engine.port_slots(topology, server)
        by_name = {slot.name: slot for slot in slots}
        slot_maps.append((server, by_name))
        env = {e.name: e for e in base_env(topology, server.role, server.devices)}
        env.update({e.name: e for e in engine.env(topology, server)})
        ranks = tuple(
            RankPlan(rank, server.device_of(rank), _title(topology, server, rank))
            for rank in range(server.tp)
        )
        processes.append(
            ProcessPlan(
                name=server.name,
                role=server.role,
                replica=server.replica,
                ranks=ranks,
                ports=tuple(slots),
                env=tuple(env.values()),
                command=engine.command(topology, server, by_name),
                probes=tuple(engine.probes(topology, server, by_name)),
                workdir=engine.workdir,
                cores=engine.cores(topology, server),
            )
        )
    router_env = tuple(base_env(topology, ROUTER, ()))
    processes.append(
        ProcessPlan(
            name=ROUTER,
            role=ROUTER,
            replica=0,
            ranks=(RankPlan(0, None, rank_title(topology.name, ROUTER, 0)),),
            ports=tuple(router_slots(topology)),
            env=router_env,
            command=router_command(topology, slot_maps),
            probes=tuple(router_probes(topology)),
        )
    )
    needs = engine.requirements(topology, requirements(topology))
    prepared = tuple(engine.preparations(topology))
    return LaunchPlan(
        loaded, tuple(processes), needs, loaded.warnings, prepared, engine.interpreter(topology)
    )
