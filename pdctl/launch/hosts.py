"""Where a run's processes start: the plug point between this host and a Ray cluster.

A `Host` reserves the ports of a run's processes, starts one planned process at a time
(the run keeps the one start loop), lists what they listen on and stops everything it
started. `make_host` picks the one the topology names (`launcher.kind`) from a
registry and imports it lazily, so Ray is touched only by topologies that use it:
`local` is `LocalHost` (this host), `ray` is `ray_host.RayHost` (the nodes of a Ray
cluster). Every host has a part on this host (`Host.local`), where a run's colocated
reference server starts. A host knows nothing of readiness or the run's record
beyond what it adds to it (`annotate`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdctl.launch.forking import Starter
from pdctl.launch.listeners import Listener, listeners
from pdctl.launch.plan import LaunchPlan, ProcessPlan
from pdctl.launch.ports import Allocation, allocate
from pdctl.launch.preparation import make_workdir, prepare
from pdctl.launch.processes import LocalSpawned, Spawned, start_time, stop_groups
from pdctl.launch.run_record import RunRecord

HOSTS = {"local": "pdctl.launch.hosts:LocalHost", "ray": "pdctl.launch.ray_host:RayHost"}


class Owner(Protocol):
    """What a host takes of the run it starts processes for (`run.Run`)."""

    plan: LaunchPlan
    name: str
    dir: Path
    detach: bool

    @property
    def host(self) -> str: ...

    def host_of(self, name: str) -> str: ...

    def workdir(self, name: str) -> Path: ...

    def env_for(
        self, process: ProcessPlan, ports: Mapping[str, int] | None = None
    ) -> dict[str, str]: ...

    def env_overrides(
        self, process: ProcessPlan, ports: Mapping[str, int] | None = None
    ) -> dict[str, str]: ...


@dataclass(frozen=True)
class Reserved:
    """Where a run's processes listen: each port slot's port, and the address of each
    process that does not run on the topology's host."""

    ports: dict[str, int]  # slot key -> port
    hosts: dict[str, str]  # process name -> its address


class Host(ABC):
    """Where the processes of one run start; it owns them, and their ports."""

    def __init__(self, run: Owner, *, forks: bool) -> None:
        """`forks`: whether the embedded servers it starts on this host may be forked
        from one process that imported them once (`forking.Starter`)."""
        self.run = run

    @property
    @abstractmethod
    def local(self) -> LocalHost:
        """This host's part of the run (where its reference server starts)."""

    @abstractmethod
    def reserve(self, processes: Sequence[ProcessPlan]) -> Reserved:
        """What comes before the first process starts: its ports (and its node)."""

    @abstractmethod
    def spawn(self, process: ProcessPlan, argv: Sequence[str], log_path: Path) -> Spawned:
        """Start one planned process; OSError or LaunchFailed when it cannot."""

    @abstractmethod
    def release(self) -> None:
        """The run serves: give back the port reservations its servers now hold."""

    @abstractmethod
    def listeners(self) -> dict[str, list[Listener]]:
        """Each process's listening TCP sockets (every rank of its process group)."""

    @abstractmethod
    def stop(self, grace: float) -> list[str]:
        """End every process it started (the last started first), give its ports back;
        the names of those something is left of."""

    def start_time(self, spawned: Spawned) -> int | None:
        """A process's start time, its identity with its PID (None where it is remote)."""
        return start_time(spawned.pid)

    @abstractmethod
    def annotate(self, record: RunRecord) -> None:
        """Add to the run's record where its processes run."""


class LocalHost(Host):
    """This host: the engine's preparations, ports under the host-wide lock, processes
    spawned (or forked, `forking.Starter`) in their own sessions."""

    def __init__(self, run: Owner, *, forks: bool) -> None:
        super().__init__(run, forks=forks)
        self.starter = Starter(run.plan.topology.name, run.dir, forks=forks)
        self.allocation: Allocation | None = None
        self.spawned: list[LocalSpawned] = []

    @property
    def local(self) -> LocalHost:
        return self

    def reserve(self, processes: Sequence[ProcessPlan]) -> Reserved:
        prepare(self.run.plan.preparations)
        slots = [slot for process in processes for slot in process.ports]
        self.allocation = allocate(slots, self.run.host)
        return Reserved(self.allocation.ports, {})

    def spawn(
        self,
        process: ProcessPlan,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> LocalSpawned:
        """Start `process` with the run's environment for it (or `env`)."""
        where = make_workdir(self.run.workdir(process.name)) if process.workdir else None
        spawned = self.starter.spawn(
            process.name,
            argv,
            self.run.env_for(process) if env is None else env,
            log_path,
            die_with_parent=not self.run.detach,
            cwd=where,
            cores=process.cores,
        )
        self.spawned.append(spawned)
        return spawned

    def release(self) -> None:
        if self.allocation is not None:
            self.allocation.release()

    def listeners(self) -> dict[str, list[Listener]]:
        return {p.name: listeners(p.pid) for p in self.spawned}

    def annotate(self, record: RunRecord) -> None:
        """Nothing: a record without `launcher` is this host's."""

    def stop(self, grace: float) -> list[str]:
        spawned = self.spawned[::-1]
        left = stop_groups([p.pid for p in spawned], grace, [p.process for p in spawned])
        self.starter.close()  # after its servers: they die with it
        self.release()
        return [p.name for p in spawned if p.pid in left]


def make_host(run: Owner, *, forks: bool) -> Host:
    """The host `run`'s topology names (`launcher.kind`); `forks`: whether this host may
    fork the embedded servers it starts (`forking`)."""
    module, _, name = HOSTS[run.plan.topology.launcher.kind].partition(":")
    host: type[Host] = getattr(importlib.import_module(module), name)
    return host(run, forks=forks)
