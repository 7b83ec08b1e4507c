"""The nodes of a Ray cluster as a run's host (`launcher: ray`).

The run is the same as on this host (start, readiness, the canary, fail-fast on an
exit with the log tail, the listener check, reference, stop, state); what differs is
where its processes start and how they are reached (ray_launcher.py): one actor per
process, placed on a node, reserves its ports there and starts it; every process
listens on its node's address. A log tail is fetched from the node when the log is
not on this host, and stopping copies every node's logs into the run directory. The
run's reference server starts on this host (`local`), spawned, never forked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pdctl.launch.hosts import Host, LocalHost, Owner, Reserved
from pdctl.launch.listeners import Listener
from pdctl.launch.plan import ProcessPlan
from pdctl.launch.processes import Spawned
from pdctl.launch.ray_launcher import NAMESPACE, RayPlacement, RemoteSpawned, Started
from pdctl.launch.run_record import NodeRecord, RunRecord
from pdctl.launch.stages import LaunchFailed


def failed(exc: Exception) -> LaunchFailed:
    """A Ray error, named as the run's failure to start."""
    if isinstance(exc, LaunchFailed):
        return exc
    return LaunchFailed(f"could not start on the Ray cluster: {exc}")


class RayHost(Host):
    def __init__(self, run: Owner, *, forks: bool) -> None:
        super().__init__(run, forks=forks)
        self._local = LocalHost(run, forks=False)  # a reference here is spawned
        self.placement: RayPlacement | None = None
        self.nodes: dict[str, NodeRecord] = {}  # process name -> its node

    @property
    def local(self) -> LocalHost:
        return self._local

    def reserve(self, processes: Sequence[ProcessPlan]) -> Reserved:
        launcher = self.run.plan.topology.launcher
        self.placement = placement = RayPlacement(self.run.name, launcher)
        ports: dict[str, int] = {}
        hosts: dict[str, str] = {}
        try:
            named = [(p.name, p.role) for p in processes]
            self.nodes = placement.place(named, launcher.startup_timeout_s)
            for process in processes:
                # every server listens on its node's address (loopback on a one-host cluster)
                hosts[process.name] = ip = str(self.nodes[process.name]["ip"])
                slots = [(s.owner, s.name, s.purpose, s.fixed) for s in process.ports]
                ports.update(placement.call(process.name, "reserve", slots, ip))
        except Exception as exc:
            raise failed(exc) from None
        return Reserved(ports, hosts)

    def spawn(self, process: ProcessPlan, argv: Sequence[str], log_path: Path) -> RemoteSpawned:
        assert self.placement is not None, "reserve comes first"
        name = process.name
        overrides = self.run.env_overrides(process)
        try:
            started: Started = self.placement.call(
                name, "spawn", name, list(argv), overrides, str(log_path), self.run.host_of(name)
            )
        except Exception as exc:
            raise failed(exc) from None
        node = self.nodes[name]
        node["log_dir"] = started["log_dir"]
        return RemoteSpawned(name, int(started["pid"]), log_path, self.placement.actors[name], node)

    def release(self) -> None:
        """Nothing yet: each node's reservations go back when its actor stops."""

    def listeners(self) -> dict[str, list[Listener]]:
        if self.placement is None:
            return {}
        return {
            name: [Listener(*row) for row in self.placement.call(name, "listeners")]
            for name in self.placement.actors
        }

    def stop(self, grace: float) -> list[str]:
        left = self.placement.stop(grace, self.run.dir) if self.placement is not None else []
        return left + self._local.stop(grace)

    def start_time(self, spawned: Spawned) -> int | None:
        return None  # a PID on another node: Ray's actor says whether it lives

    def annotate(self, record: RunRecord) -> None:
        address = self.run.plan.topology.launcher.address
        record["launcher"] = "ray"
        record["ray"] = {"address": address, "namespace": NAMESPACE, "nodes": self.nodes}
        for process in record["processes"]:
            process["node"] = self.nodes.get(process["name"])
