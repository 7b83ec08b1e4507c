"""A run whose processes live on the nodes of a Ray cluster (`launcher: ray`).

`make_run(plan)` (launcher.py) makes a RayRun when the topology says `launcher:
ray`; everything above the launcher (up, status, logs, down, verify, nightly, the
benchmarks) is the same. What differs is where processes start and how they are reached: see
ray_launcher.py. Readiness, the canary, fail-fast on an exit (with the log tail,
fetched from the node when it is another host) and the listener check are the
local launcher's.
"""

from __future__ import annotations

from typing import Any

from pdctl.engines.command import render_command
from pdctl.launch.listeners import Listener
from pdctl.launch.plan import LaunchPlan
from pdctl.launch.ray_launcher import RayPlacement, RemoteSpawned
from pdctl.launch.run import LaunchFailed, ProcessState, Run


class RayRun(Run):
    def __init__(self, plan: LaunchPlan, *args: Any, **kwargs: Any) -> None:
        super().__init__(plan, *args, **kwargs)
        self.starter.forks = False  # its servers start on the cluster's nodes
        self.ray: RayPlacement | None = None
        self.remote_ports: dict[str, int] = {}  # ports reserved on each process's node
        self.nodes: dict[str, Any] = {}  # process -> {ip, node_id, hostname}

    @property
    def ports(self) -> dict[str, int]:
        return self.remote_ports

    def start(self) -> None:
        launcher = self.plan.topology.launcher
        self.ray = RayPlacement(self.name, launcher.address, launcher.placement, launcher.resources)
        try:
            self.nodes = self.ray.place(
                [(p.name, p.role) for p in self.plan.processes], launcher.startup_timeout_s
            )
            for process in self.plan.processes:
                # every server listens on its node's address (loopback on a one-host cluster)
                self.hosts[process.name] = ip = str(self.nodes[process.name]["ip"])
                slots = [(s.owner, s.name, s.purpose, s.fixed) for s in process.ports]
                self.remote_ports.update(self.ray.call(process.name, "reserve", slots, ip))
            self.dir.mkdir(parents=True, exist_ok=True)
            for process in self.plan.processes:
                url = f"http://{self.host_of(process.name)}:{self.ports[f'{process.name}.http']}"
                self.states.append(ProcessState(process, url))
            for state in self.states:
                name = state.plan.name
                argv = render_command(state.plan.command, self.render_map)
                log_path = self.dir / f"{name}-tp0.log"
                started = self.ray.call(
                    name,
                    "spawn",
                    name,
                    argv,
                    self.env_overrides(state.plan),
                    str(log_path),
                    self.host_of(name),
                )
                self.nodes[name]["log_dir"] = started["log_dir"]
                state.spawned = RemoteSpawned(  # type: ignore[assignment]
                    name, int(started["pid"]), log_path, self.ray.actors[name], self.nodes[name]
                )
        except LaunchFailed:
            self.stop()
            raise
        except Exception as exc:  # a Ray error: name it, leave nothing behind
            self.stop()
            raise LaunchFailed(f"could not start on the Ray cluster: {exc}") from None
        self.write_state()

    def listeners(self) -> dict[str, list[Listener]]:
        if self.ray is None:
            return {}
        return {
            name: [Listener(*row) for row in self.ray.call(name, "listeners")]
            for name in self.ray.actors
        }

    def stop(self, grace: float = 5.0) -> list[str]:
        left = self.ray.stop(grace, self.dir) if self.ray is not None else []
        if self.state_path is not None and not left:
            self.state_path.unlink(missing_ok=True)
        return left

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        data["launcher"] = "ray"
        data["ray"] = {
            "address": self.plan.topology.launcher.address,
            "namespace": "pdctl",
            "nodes": self.nodes,
        }
        for process in data["processes"]:
            process["start_time"] = None  # a PID on another node: Ray's actor says if it lives
            process["node"] = self.nodes.get(process["name"])
        return data
