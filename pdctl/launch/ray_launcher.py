"""`launcher: ray`: each server process of a run on a node of a Ray cluster.

pdctl does not manage remote hosts itself. For every process of the plan it creates
one small Ray actor (no CPU of its own), placed by a placement group: one bundle per
process, the role's `launcher.resources` in it (how a role is pinned to nodes), the
bundles spread across nodes or packed. The actor does on its node what the local
launcher does on this host: it reserves the process's ports (the same host-wide
reservations), starts the server in its own process group with the same environment
(the topology's and the run's variables, its secret; loopback confinement when the
node's address is loopback), writes its log, reports its exit, and ends the group.
The server dies with its actor (parent-death signal), and the actor is detached and
named `<run>/<process>` in the `pdctl` namespace, so `pdctl down` from another shell
finds it. Every process listens on its node's address, and the commands name each
other by those addresses (`<name>.host`).

Logs: each server (and its TP ranks) writes on its node, into the run directory's
path when the node can create it, else into `$PDCTL_NODE_LOG_DIR/<run>` (set in the
environment the node was started with) or a temporary folder. `pdctl logs` reads
the tails of logs that are not on this host through the actors, and stopping a run
copies every log of every node into the run directory here, after the servers
ended (so their last lines are in it) and before the actors go.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from pdctl.errors import LaunchError
from pdctl.launch.run_record import NodeRecord
from pdctl.launch.settings import LaunchSettings
from pdctl.settings import LOG_DIR_VAR
from pdctl.topology.model import LauncherSpec

NAMESPACE = "pdctl"
# Ray gives an actor without GPUs an empty device list; servers get the topology's own.
RAY_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
CALL_TIMEOUT_S = 60.0
LOG_COPY_BYTES = 16 << 20  # the last 16 MiB of each log is copied


def node_log_dir(run_dir: Path, settings: LaunchSettings) -> Path:
    """Where servers on this node write the run's logs (see the module docstring)."""
    if settings.node_log_dir is not None:
        return settings.node_log_dir / run_dir.name
    with contextlib.suppress(OSError):
        run_dir.mkdir(parents=True, exist_ok=True)
        if os.access(run_dir, os.W_OK | os.X_OK):
            return run_dir
    return Path(tempfile.gettempdir()) / f"pdctl-logs-{os.getuid()}" / run_dir.name


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LaunchError(
            "launcher: ray needs the ray package", hint="pip install 'pdctl[ray]'"
        ) from None
    return ray


def connect(address: str) -> Any:
    """Connect this process to the cluster (`local` starts one here, on loopback)."""
    if address == "local":
        # a one-node instance for this process, all of it on loopback: Ray reads this when
        # it is imported (without it Ray registers the node under the host's routable
        # address)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = import_ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if address == "local":
            ray.init(
                address="local",  # a new instance, even when a cluster runs on this host
                namespace=NAMESPACE,
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address="127.0.0.1",
            )
        else:
            ray.init(
                address=None if address == "auto" else address,
                namespace=NAMESPACE,
                log_to_driver=False,
            )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LaunchError(
            f"cannot connect to the Ray cluster at {address!r}: {exc}",
            hint="start one (`ray start --head`), set launcher.address, or use address: local",
        ) from None
    if address == "local":
        addresses = {str(node["NodeManagerAddress"]) for node in ray.nodes()}
        if not all(ipaddress.ip_address(a).is_loopback for a in addresses):
            ray.shutdown()
            raise LaunchError(
                f"the local Ray instance registered {', '.join(sorted(addresses))}, not loopback",
                hint="start pdctl in a fresh process (ray was imported before pdctl set "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), or use a cluster address",
            )
    return ray


class Started(TypedDict):
    """A server its actor started: its pid on the node, and where its ranks log there."""

    pid: int
    log_dir: str


class ProcessHost:
    """The actor: one server process on this node (methods run in the actor)."""

    def __init__(self) -> None:
        self.process: Any = None
        self.name = ""
        self.log_path: Path | None = None  # rank 0's log on this node
        self.allocation: Any = None

    def node(self) -> NodeRecord:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        # the address the node joined the cluster with (not a guess from this worker:
        # a worker would pick the host's routable address even on a loopback node)
        ip = next(
            (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id),
            ray.util.get_node_ip_address(),
        )
        return {"ip": ip, "node_id": node_id, "hostname": socket.gethostname()}

    def reserve(self, slots: list[tuple[str, str, str, int | None]], host: str) -> dict[str, int]:
        from pdctl.engines.command import PortSlot
        from pdctl.launch.ports import allocate

        self.allocation = allocate([PortSlot(*slot) for slot in slots], host)
        return dict(self.allocation.ports)

    def release(self) -> None:
        if self.allocation is not None:
            self.allocation.release()
            self.allocation = None

    def spawn(
        self, name: str, argv: list[str], overrides: dict[str, str], log_path: str, host: str
    ) -> Started:
        """Start the server; its pid and the folder its ranks log into on this node."""
        from pdctl.launch.processes import process_env, spawn

        wanted = Path(log_path)
        node_env = {k: v for k, v in os.environ.items() if k not in RAY_DEVICE_VARS}
        settings = LaunchSettings.from_environ({**node_env, **overrides})  # the node's, the run's
        directory = node_log_dir(wanted.parent, settings)
        overrides = {**overrides, LOG_DIR_VAR: str(directory)}  # TP ranks > 0 log beside rank 0
        env, warning = process_env(node_env, overrides, host, settings.loopback_shim)
        self.name, self.log_path = name, directory / wanted.name
        spawned = spawn(name, argv, env, self.log_path, die_with_parent=True)
        self.process = spawned.process
        if warning:
            with open(self.log_path, "a") as log:
                log.write(f"pdctl: {warning}\n")
        return {"pid": int(spawned.pid), "log_dir": str(directory)}

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def alive(self) -> bool:
        from pdctl.launch.processes import group_alive

        return self.process is not None and group_alive(self.process.pid)

    def log_tail(self, lines: int) -> str:
        from pdctl.launch.processes import tail

        return tail(self.log_path, lines) if self.log_path else ""

    def read_logs(self) -> dict[str, bytes]:
        """File name -> the end of each rank's log of this server on this node."""
        if self.log_path is None:
            return {}
        found = {}
        for path in sorted(self.log_path.parent.glob(f"{self.name}-tp*.log")):
            with contextlib.suppress(OSError), open(path, "rb") as handle:
                handle.seek(max(0, path.stat().st_size - LOG_COPY_BYTES))
                found[path.name] = handle.read()
        return found

    def listeners(self) -> list[tuple[int, str, int]]:
        from pdctl.launch.listeners import listeners

        if self.process is None:
            return []
        return [(x.pid, x.address, x.port) for x in listeners(self.process.pid)]

    def stop(self, grace: float) -> bool:
        """End the process group; True when nothing of it is left."""
        from pdctl.launch.processes import group_alive, stop_groups

        self.release()
        if self.process is None:
            return True
        stop_groups([self.process.pid], grace, [self.process])
        return not group_alive(self.process.pid)


@dataclass
class RemoteSpawned:
    """A server started by a ProcessHost actor (a `processes.Spawned`)."""

    name: str
    pid: int
    log_path: Path
    actor: Any
    node: NodeRecord

    def _call(self, method: str, *args: Any) -> Any:
        return _ask(import_ray(), self.actor, method, *args)

    def exit_description(self) -> str | None:
        from pdctl.launch.processes import describe_exit

        try:
            code = self._call("poll")
        except Exception as exc:  # the actor (or its node) is gone: so is the server
            return f"lost with its Ray actor ({type(exc).__name__})"
        return None if code is None else describe_exit(int(code))

    def log_tail(self, lines: int = 30) -> str:
        from pdctl.launch.processes import tail

        if self.log_path.exists():
            return tail(self.log_path, lines)
        try:
            return str(self._call("log_tail", lines))
        except Exception:
            return ""


class RayPlacement:
    """The actors and placement group of one run."""

    def __init__(self, run_name: str, launcher: LauncherSpec) -> None:
        self.ray = connect(launcher.address)
        self.run_name, self.address = run_name, launcher.address
        self.strategy = "PACK" if launcher.placement == "pack" else "SPREAD"
        self.resources: Mapping[str, Mapping[str, float]] = launcher.resources
        self.actors: dict[str, Any] = {}
        self.group: Any = None

    def place(self, processes: Sequence[tuple[str, str]], timeout: float) -> dict[str, NodeRecord]:
        """One actor per (process name, role); name -> its node {ip, node_id, hostname}."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [{"CPU": 0.01, **self.resources.get(role, {})} for _, role in processes]
        # detached, like the actors: a driver's own group (and its actors) ends with it
        self.group = placement_group(
            bundles, strategy=self.strategy, name=f"{self.run_name}/group", lifetime="detached"
        )
        ready = self.group.ready()
        done, _ = self.ray.wait([ready], timeout=timeout)
        if not done:
            self.close()
            raise LaunchError(
                f"the Ray cluster at {self.address} cannot place the run's {len(bundles)} "
                f"servers within {timeout:g} s (bundles: {bundles}, strategy {self.strategy})",
                hint="check `ray status`: each bundle needs a node with those resources",
            )
        remote = self.ray.remote(ProcessHost)
        nodes: dict[str, NodeRecord] = {}
        for index, (name, role) in enumerate(processes):
            actor = remote.options(
                name=f"{self.run_name}/{name}",
                namespace=NAMESPACE,
                lifetime="detached",
                num_cpus=0.01,
                resources=dict(self.resources.get(role, {})),
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=index
                ),
            ).remote()
            self.actors[name] = actor
        for name, actor in self.actors.items():
            nodes[name] = self.ray.get(actor.node.remote(), timeout=timeout)
        return nodes

    def call(self, name: str, method: str, *args: Any) -> Any:
        return _ask(self.ray, self.actors[name], method, *args)

    def stop(self, grace: float, run_dir: Path | None = None) -> list[str]:
        """End every server (router first: reverse order), copy its logs into `run_dir`,
        then end the actors; the names of servers something is left of."""
        left = [
            name
            for name in reversed(list(self.actors))
            if not _end(self.ray, self.actors[name], grace, run_dir)
        ]
        self.close()
        return left

    def close(self) -> None:
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        self.actors.clear()
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(self.group)
            self.group = None


def _end(ray: Any, actor: Any, grace: float, run_dir: Path | None = None) -> bool:
    """Stop the actor's server, copy its logs into `run_dir`, end the actor; False when
    something of the server is left."""
    try:
        return bool(ray.get(actor.stop.remote(grace), timeout=CALL_TIMEOUT_S))
    except Exception:  # the actor is already gone, and its server died with it
        return True
    finally:
        if run_dir is not None:
            copy_logs(ray, actor, run_dir)
        with contextlib.suppress(Exception):
            ray.kill(actor)


def copy_logs(ray: Any, actor: Any, run_dir: Path) -> list[str]:
    """Write the logs of the actor's server that this host lacks into `run_dir` (a
    node on this host that wrote into the run directory itself leaves nothing to
    copy); the names copied. A node that is gone keeps its logs."""
    try:
        logs: dict[str, bytes] = _ask(ray, actor, "read_logs")
    except Exception:
        return []
    copied = []
    for name, data in logs.items():
        target = run_dir / Path(name).name
        if target.exists():
            continue
        with contextlib.suppress(OSError):
            run_dir.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            copied.append(target.name)
    return copied


def _recorded(record: Mapping[str, Any]) -> tuple[Any, list[tuple[str, Any]]]:
    """For a run started elsewhere: Ray, and (process name, its actor or None if gone)."""
    ray = connect(str((record.get("ray") or {}).get("address", "auto")))
    found = []
    for process in record.get("processes", []):
        try:
            actor = ray.get_actor(f"{record['name']}/{process['name']}", namespace=NAMESPACE)
        except ValueError:
            actor = None
        found.append((str(process["name"]), actor))
    return ray, found


def _ask(ray: Any, actor: Any, method: str, *args: Any) -> Any:
    return ray.get(getattr(actor, method).remote(*args), timeout=CALL_TIMEOUT_S)


def stop_recorded(record: Mapping[str, Any], grace: float = 5.0) -> list[str]:
    """`pdctl down` of a Ray run started elsewhere: find its named actors, end them,
    and collect their logs into the run directory."""
    ray, actors = _recorded(record)
    run_dir = Path(str(record["run_dir"])) if record.get("run_dir") else None
    left = [
        name for name, actor in reversed(actors) if actor and not _end(ray, actor, grace, run_dir)
    ]
    with contextlib.suppress(Exception):
        group = ray.util.get_placement_group(f"{record['name']}/group")
        ray.util.remove_placement_group(group)
    return left


def recorded_log_tails(
    record: Mapping[str, Any], lines: int, wanted: Callable[[str], bool] = lambda _: True
) -> dict[str, str]:
    """Process name -> the tail of its rank-0 log, read on its node (`pdctl logs`), for
    the processes `wanted` says."""
    ray, actors = _recorded(record)
    found = {}
    for name, actor in actors:
        if not wanted(name):
            continue
        with contextlib.suppress(Exception):
            found[name] = str(_ask(ray, actor, "log_tail", lines))
    return found


def recorded_alive(record: Mapping[str, Any]) -> dict[str, bool]:
    """Process name -> whether its server still runs (for `pdctl status` of a Ray run)."""
    ray, actors = _recorded(record)
    found = {}
    for name, actor in actors:
        try:
            found[name] = actor is not None and bool(_ask(ray, actor, "alive"))
        except Exception:
            found[name] = False
    return found
