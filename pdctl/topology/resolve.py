"""Derived values of a topology: server layout, devices, environment layers, requirements.

This is the one resolver for values a user does not write: which physical devices
each rank gets, which environment each process sees and where every variable comes
from, and what the machine must have. Engine-specific parts (command lines, extra
ports) are added by `pdctl.engines`; this module does not know any engine's flags.

Device assignment, for a role without explicit `devices` on an accelerator:

    explicit:  prefill devices [0]          -> prefill-0: (0,)
    derived:   decode tp 2, replicas 1      -> decode-0: (1, 2)   lowest free indices
    derived:   encoder tp 1, replicas 2     -> encoder-0: (3,), encoder-1: (4,)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from pdctl.core import DEVICE_VISIBILITY_VARS
from pdctl.settings import FAULTS_VAR, RUN_ID_VAR, RUN_SECRET_VAR
from pdctl.topology.model import RoleSpec, Topology


@dataclass(frozen=True)
class ServerLayout:
    """One server process of a role: a replica with its tp ranks and devices."""

    role: str
    replica: int
    tp: int
    devices: tuple[int, ...]  # physical indices, one per rank; empty on cpu

    @property
    def name(self) -> str:
        return f"{self.role}-{self.replica}"

    def device_of(self, rank: int) -> int | None:
        return self.devices[rank] if rank < len(self.devices) else None

    @property
    def shares_devices(self) -> bool:
        return len(set(self.devices)) < len(self.devices)

    @property
    def local_devices(self) -> tuple[int, ...]:
        """Each rank's index inside the process's device mask (which lists each device
        once): 0..tp-1 normally, repeats where ranks share a device."""
        order = list(dict.fromkeys(self.devices))
        return tuple(order.index(index) for index in self.devices)


@dataclass(frozen=True)
class EnvEntry:
    """A variable pdctl sets for a process, and the topology key it comes from."""

    name: str
    value: str
    source: str
    secret: bool = False
    overrides: str | None = None  # the lower layer whose value this one replaced

    def shown(self) -> str:
        return "<secret, per run>" if self.secret else self.value


@dataclass(frozen=True)
class Requirements:
    """What the machine must have, explicit in `requires:` or derived from the topology."""

    device_type: str
    device_count: int
    min_free_memory_gb: float | None
    modules: tuple[str, ...]
    capabilities: tuple[str, ...]
    reasons: Mapping[str, str] = field(default_factory=dict)  # item -> why it is required
    python: str | None = None  # the engine's interpreter (None: pdctl's own)
    engine_modules: tuple[str, ...] = ()  # importable by `python`
    cpu_cores: int = 0  # cores this process may run on (one per server rank, where placed)

    def to_json(self) -> dict[str, object]:
        return {
            "device_type": self.device_type,
            "device_count": self.device_count,
            "min_free_memory_gb": self.min_free_memory_gb,
            "modules": list(self.modules),
            "capabilities": list(self.capabilities),
            "python": self.python,
            "engine_modules": list(self.engine_modules),
            "cpu_cores": self.cpu_cores,
            "reasons": dict(self.reasons),
        }


def _chunks(indices: list[int], size: int, count: int) -> list[tuple[int, ...]]:
    return [tuple(indices[i * size : (i + 1) * size]) for i in range(count)]


def assign_devices(topology: Topology) -> dict[str, list[tuple[int, ...]]]:
    """Role -> one tuple of physical device indices per replica (empty tuples on cpu)."""
    roles = topology.roles.items()
    if topology.device == "cpu":
        return {role: [()] * spec.replicas for role, spec in roles}
    taken = {index for _, spec in roles for index in spec.devices or []}
    assigned: dict[str, list[tuple[int, ...]]] = {}
    candidate = 0
    for role, spec in roles:
        if spec.devices is not None:
            assigned[role] = _chunks(list(spec.devices), spec.tp, spec.replicas)
            continue
        picked: list[int] = []
        while len(picked) < spec.tp * spec.replicas:
            if candidate not in taken:
                picked.append(candidate)
            candidate += 1
        assigned[role] = _chunks(picked, spec.tp, spec.replicas)
    return assigned


def servers(topology: Topology) -> list[ServerLayout]:
    """Every server process, in launch order (encoder, prefill, decode)."""
    devices = assign_devices(topology)
    return [
        ServerLayout(role, replica, spec.tp, devices[role][replica])
        for role, spec in topology.roles.items()
        for replica in range(spec.replicas)
    ]


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity: taskset and cpusets included)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def cpu_placement(
    topology: Topology, cores: tuple[int, ...]
) -> dict[str, tuple[tuple[int, ...], ...]] | None:
    """Each rank of each server its own cores, on a CPU topology: the cores split evenly
    over every server rank in launch order, the rest left to pdctl and the router. None
    when there are fewer cores than ranks (the requirements then say so).

        cores 0-3, prefill tp 1, decode tp 2:  prefill-0: (0,)   decode-0: (1,), (2,)
    """
    layout = servers(topology)
    ranks = sum(server.tp for server in layout)
    if not ranks or len(cores) < ranks:
        return None
    width = len(cores) // ranks
    placed: dict[str, tuple[tuple[int, ...], ...]] = {}
    start = 0
    for server in layout:
        groups = []
        for _ in range(server.tp):
            groups.append(tuple(cores[start : start + width]))
            start += width
        placed[server.name] = tuple(groups)
    return placed


def role_spec(topology: Topology, role: str) -> RoleSpec:
    spec = dict(topology.roles.items()).get(role)
    if spec is None:
        raise KeyError(f"topology has no role {role!r}")
    return spec


def _layers(topology: Topology, role: str) -> Iterator[tuple[str, Mapping[str, str]]]:
    yield "env", topology.env
    if role == "router":
        yield "router.env", topology.router.env
    else:
        yield f"roles.{role}.env", role_spec(topology, role).env


def merged_user_env(topology: Topology, role: str) -> dict[str, str]:
    """Topology env overlaid with the role's env (role wins)."""
    merged: dict[str, str] = {}
    for _, layer in _layers(topology, role):
        merged.update(layer)
    return merged


# fault -> the roles that inject it (kill-role: the role it names). `colocated` is the
# reference verify starts: an engine fault (perturb-prefix-hit) is in it too, as engine
# behaviour would be, so that the control without transfer shows it as well.
FAULT_ROLES: dict[str, tuple[str, ...]] = {
    "corrupt-kv": ("prefill",),
    "delay-transfer": ("prefill",),
    "drop-scatter": ("decode",),
    "corrupt-embedding": ("encoder",),
    "perturb-prefix-hit": ("prefill", "colocated"),
    "abort-transfer": ("prefill", "decode"),
}


def faults_of(topology: Topology, role: str) -> list[dict[str, object]]:
    """The faults `role` must inject, as the JSON its servers read from `FAULTS_VAR`."""
    found = []
    for fault in topology.faults:
        targets = (fault.role,) if fault.name == "kill-role" else FAULT_ROLES[fault.name]
        if role in targets:
            # spare: the launcher's canary, the first request through a new topology,
            # is never faulted (start-up must succeed for the checks to run at all)
            found.append({**fault.model_dump(exclude_none=True), "spare": 1})
    return found


def base_env(topology: Topology, role: str, devices: tuple[int, ...]) -> list[EnvEntry]:
    """Environment layers common to every engine, lowest precedence first.

    parent env < topology `env` < role `env` < device visibility < per-run values.
    """
    merged: dict[str, EnvEntry] = {}
    for source, layer in _layers(topology, role):
        for name, value in layer.items():
            below = merged.get(name)
            merged[name] = EnvEntry(name, value, source, overrides=below.source if below else None)
    visibility = DEVICE_VISIBILITY_VARS.get(topology.device)
    if visibility and devices:
        # ranks sharing a device (roles.<role>.share_devices) see it once
        value = ",".join(str(index) for index in dict.fromkeys(devices))
        merged[visibility] = EnvEntry(visibility, value, f"roles.{role}.devices")
    merged[RUN_ID_VAR] = EnvEntry(RUN_ID_VAR, "<per run>", "pdctl")
    merged[RUN_SECRET_VAR] = EnvEntry(RUN_SECRET_VAR, "", "pdctl", secret=True)
    faults = faults_of(topology, role)
    if faults:
        merged[FAULTS_VAR] = EnvEntry(FAULTS_VAR, json.dumps(faults), "faults")
    return list(merged.values())


def _any_env_set(topology: Topology, names: tuple[str, ...]) -> str | None:
    """The first of `names` set (to any value) in any role's environment, else None."""
    roles = [role for role, _ in topology.roles.items()] + ["router"]
    for role in roles:
        env = merged_user_env(topology, role)
        for name in names:
            if name in env:
                return name
    return None


Need = tuple[str, str, str]  # (module | capability, name, why)


def transport_needs(topology: Topology) -> Iterator[Need]:
    """(module | capability, name, why) the transfer backend needs where it is imported."""
    backend = topology.transfer.backend
    if backend == "mooncake":
        yield "module", "mooncake.engine", "transfer.backend: mooncake"
        if topology.transfer.effective_protocol == "rdma":
            yield "capability", "mooncake.rdma", "transfer.protocol: rdma"
        tent = _any_env_set(topology, ("MC_USE_TENT", "MC_USE_TEV1"))
        if tent is not None:  # Mooncake engages TENT whenever it is set, to any value
            yield "capability", "mooncake.tent", f"{tent} set: Mooncake then runs its TENT engine"
    elif backend == "nixl":
        yield "module", "nixl", "transfer.backend: nixl"
        plugin = (topology.transfer.nixl_backend or "UCX").lower()
        yield "capability", f"nixl.{plugin}", f"the NIXL {plugin.upper()} plugin moves the KV"


def requirements(topology: Topology, process_needs: Iterable[Need] = ()) -> Requirements:
    """What the machine needs: `requires:`, the devices the roles use, the router and
    launcher; `process_needs` what the engine imports in pdctl's own interpreter (pdctl's
    servers: the transport; another engine checks its own in its interpreter)."""
    explicit = topology.requires
    reasons: dict[str, str] = {}
    needed = 0
    if topology.device != "cpu":
        used = [index for server in servers(topology) for index in server.devices]
        needed = max(used) + 1 if used else 0
    count = max(explicit.device_count or 0, needed)
    if count and explicit.device_count is None:
        reasons[f"device_count={count}"] = "the highest device index the roles use"
    modules = list(explicit.modules)
    capabilities: list[str] = list(explicit.capabilities)

    def need(items: list[str], item: str, why: str) -> None:
        if item not in items:
            items.append(item)
            reasons[item] = why

    for kind, item, why in process_needs:
        need(modules if kind == "module" else capabilities, item, why)
    if topology.router.kind == "sglang-router":
        need(modules, "sglang_router", "router: sglang-router")
    if topology.launcher.kind == "ray":
        need(modules, "ray", "launcher: ray")
    return Requirements(
        device_type=topology.device,
        device_count=count,
        min_free_memory_gb=explicit.min_free_memory_gb,
        modules=tuple(modules),
        capabilities=tuple(capabilities),
        reasons=reasons,
    )
