"""Rules for the transfer section and for environment overrides.

Environment variables are where topologies go silently wrong: a protocol set twice
with different values, a boolean spelt `yes` that a library reads as false, a device
mask that fights the `devices` key. These rules turn each into a located error.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

from pdctl.core import DEVICE_VISIBILITY_VARS
from pdctl.settings import PREFIX, RETIRED
from pdctl.topology.issues import Issue, KeyPath, RuleContext
from pdctl.topology.model import Topology
from pdctl.topology.resolve import merged_user_env

# Variables whose values pdctl can check, with the values their readers accept.
KNOWN_VALUES: dict[str, tuple[str, ...]] = {
    "MOONCAKE_PROTOCOL": ("tcp", "rdma"),
    "TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": ("0", "1"),
    "TORCHDYNAMO_DISABLE": ("0", "1"),
}
# Variables pdctl derives from topology keys; setting them by hand would fight the key.
DERIVED_BY_PDCTL: dict[str, str] = {
    "SGLANG_DISAGG_STAGING_BUFFER": "transfer.staging.enabled",
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "transfer.staging.pool_size_mb",
    "SGLANG_DISAGGREGATION_NIXL_BACKEND": "transfer.nixl_backend",
}
# Mooncake engages TENT whenever one of these is set, to any value: "0" turns it ON
# (mooncake-transfer-engine/src/transfer_engine.cpp: `if (getenv("MC_USE_TENT") ||
# getenv("MC_USE_TEV1"))`). A value that reads as "off" is the trap; removing is off.
TENT_VARIABLES = ("MC_USE_TENT", "MC_USE_TEV1")
READS_AS_OFF = ("", "0", "false", "no", "off", "n", "f")
BACKEND_PREFIXES = {"MC_": "mooncake", "MOONCAKE_": "mooncake", "NIXL_": "nixl", "UCX_": "nixl"}


def transfer_rules(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    transfer = topology.transfer
    if transfer.protocol is not None and transfer.backend != "mooncake":
        yield Issue(
            ("transfer", "protocol"),
            f"protocol applies to the mooncake backend, but backend is {transfer.backend}",
            "remove transfer.protocol",
        )
    if transfer.ib_devices and transfer.effective_protocol != "rdma":
        yield Issue(
            ("transfer", "ib_devices"),
            "RDMA devices apply only with transfer.protocol: rdma",
            "set protocol: rdma, or remove ib_devices",
        )
    if transfer.backend == "mooncake" and transfer.protocol == "rdma" and not transfer.ib_devices:
        yield Issue(
            ("transfer", "protocol"),
            "rdma without transfer.ib_devices lets Mooncake pick the RDMA devices itself",
            "name the devices (for example [mlx5_0]) so the choice is explicit",
            severity="warning",
        )
    if transfer.nixl_backend is not None and transfer.backend != "nixl":
        yield Issue(
            ("transfer", "nixl_backend"),
            f"nixl_backend applies to the nixl backend, but backend is {transfer.backend}",
        )


def _layers(topology: Topology) -> Iterator[tuple[KeyPath, Mapping[str, str]]]:
    yield ("env",), topology.env
    for role, spec in topology.roles.items():
        yield ("roles", role, "env"), spec.env
    yield ("router", "env"), topology.router.env


def _variable_issues(topology: Topology, where: KeyPath, name: str, value: str) -> Iterator[Issue]:
    for issue in _variable_problems(topology, where, name, value):
        yield replace(issue, at_key=True)


def _variable_problems(
    topology: Topology, where: KeyPath, name: str, value: str
) -> Iterator[Issue]:
    path = (*where, name)
    if name in RETIRED:
        yield Issue(
            path,
            f"{name} is no longer read: {RETIRED[name]} says this now",
            f"set {RETIRED[name]} (true: fixed-order kernels; false: the vendor fast path)",
        )
    elif name.startswith(PREFIX):
        yield Issue(path, f"{name} is reserved for pdctl's own per-run values")
    visibility = DEVICE_VISIBILITY_VARS.get(topology.device)
    if name == visibility:
        role = where[1] if where[0] == "roles" else "<role>"
        yield Issue(
            path,
            f"{name} is derived from roles.{role}.devices on {topology.device}",
            f"set roles.{role}.devices instead",
        )
    if name in DERIVED_BY_PDCTL:
        yield Issue(
            path,
            f"{name} is set by pdctl from {DERIVED_BY_PDCTL[name]}",
            f"set {DERIVED_BY_PDCTL[name]} instead",
        )
    if name in TENT_VARIABLES and value.strip().lower() in READS_AS_OFF:
        yield Issue(
            path,
            f"{name}={value!r} turns TENT on: Mooncake engages TENT whenever {name} is set, "
            "to any value",
            f"remove {name} to keep TENT off; set it to '1' to ask for TENT",
        )
    elif name in TENT_VARIABLES and value != "1":
        yield Issue(
            path,
            f"{name}={value!r} asks for TENT (Mooncake reads only whether it is set)",
            "write '1', the spelling everyone reads the same way",
            severity="warning",
        )
    allowed = KNOWN_VALUES.get(name)
    if allowed and value not in allowed:
        yield Issue(path, f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    for prefix, backend in BACKEND_PREFIXES.items():
        if name.startswith(prefix) and topology.transfer.backend != backend:
            yield Issue(
                path,
                f"{name} has no effect: transfer.backend is {topology.transfer.backend}",
                severity="warning",
            )
            break


def env_rules(topology: Topology, context: RuleContext) -> Iterator[Issue]:
    for where, layer in _layers(topology):
        for name, value in layer.items():
            yield from _variable_issues(topology, where, name, value)
    if topology.transfer.backend != "mooncake":
        return
    wanted = topology.transfer.effective_protocol
    for role, spec in topology.roles.items():
        protocol = merged_user_env(topology, role).get("MOONCAKE_PROTOCOL")
        if protocol in KNOWN_VALUES["MOONCAKE_PROTOCOL"] and protocol != wanted:
            where = ("roles", role, "env") if "MOONCAKE_PROTOCOL" in spec.env else ("env",)
            yield Issue(
                (*where, "MOONCAKE_PROTOCOL"),
                f"MOONCAKE_PROTOCOL={protocol} disagrees with transfer.protocol ({wanted}) "
                f"for {role}",
                "set transfer.protocol once; pdctl passes it to every process",
                at_key=True,
            )
            break
