"""What an engine provides to the launcher: ports it needs, environment, command line.

An engine turns one server of a resolved topology into the exact command pdctl will
spawn. Commands are built from `Arg`s whose parts may be `PortRef`s: ports are
allocated only at launch, so a plan shows `<prefill-0.http>` where a port goes and
the launcher renders the real number. Engines start nothing themselves.
"""

from __future__ import annotations

import shutil
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from pdctl.core import read_checkpoint_shape
from pdctl.engines.checkpoint import ModelPath, checkpoint_issues
from pdctl.engines.command import Command, PortSlot
from pdctl.engines.dialect import Dialect, GenerateDialect
from pdctl.engines.probes import Probe
from pdctl.engines.proof import TransferProof
from pdctl.topology.issues import Issue
from pdctl.topology.model import Topology
from pdctl.topology.resolve import EnvEntry, Requirements, ServerLayout, role_spec


def python() -> str:
    """The interpreter pdctl runs under; pdctl's own servers run in the same environment."""
    return sys.executable or "python3"


def engine_python(topology: Topology) -> str:
    """The interpreter of the engine's own environment: `engine_python` (absolute once
    loaded when it is a path), a command looked up on PATH, by default python3."""
    written = topology.engine_python or "python3"
    if "/" in written:
        return written
    return shutil.which(written) or written


@dataclass(frozen=True)
class Preparation:
    """A step the launcher runs (in pdctl's interpreter) before any server starts, unless
    `marker` already holds `marker_text`: the preset written as a checkpoint."""

    what: str
    argv: tuple[str, ...]
    marker: str
    marker_text: str


def base_slots(topology: Topology, server: ServerLayout) -> list[PortSlot]:
    """HTTP for every server, bootstrap for prefill."""
    spec = role_spec(topology, server.role)
    slots = [PortSlot(server.name, "http", "HTTP API", spec.port)]
    if server.role == "prefill":
        fixed = getattr(spec, "bootstrap_port", None)
        slots.append(PortSlot(server.name, "bootstrap", "bootstrap endpoint for decode", fixed))
    return slots


REFERENCE = "reference"  # the owner of the reference server's ports


@dataclass(frozen=True)
class ReferenceSpec:
    """A colocated server of the topology's engine and model, no PD: what verify's
    reference pass and its control before blame compare with."""

    slots: tuple[PortSlot, ...]
    command: Command
    probes: tuple[Probe, ...]
    env: tuple[EnvEntry, ...] = ()  # the engine's variables (placeholders filled at launch)
    cores: tuple[int, ...] = ()  # its CPU affinity (every core where empty)


class Engine(ABC):
    """An engine: per-server ports, environment and command line."""

    name: ClassVar[str]
    # flag -> the topology key that sets it; users must not pass these in `args`.
    managed_flags: ClassVar[Mapping[str, str]]
    dialect: ClassVar[Dialect] = GenerateDialect()  # how verify phrases a request
    proof: ClassVar[TransferProof | None] = None  # the engine's own transfer accounting
    workdir: ClassVar[bool] = False  # each server runs in its own folder of the run
    pd_flow: ClassVar[str] = "bootstrap"  # how a router splits a request (serve/router)
    # pdctl's own servers: answers carry KV digests, faults and pdctl's benchmarks apply
    own_servers: ClassVar[bool] = False
    # model.path may be a Hugging Face hub id, which only the engine resolves
    takes_hub_ids: ClassVar[bool] = True

    @abstractmethod
    def port_slots(self, topology: Topology, server: ServerLayout) -> list[PortSlot]: ...

    @abstractmethod
    def command(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> Command:
        """`slots` maps slot name -> slot for this server (http, bootstrap, ...)."""

    def env(self, topology: Topology, server: ServerLayout) -> list[EnvEntry]:
        """Engine-specific variables derived from topology keys."""
        return []

    @abstractmethod
    def probes(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> list[Probe]:
        """How the launcher tells this server is up, on the engine's own endpoints, in
        order (healthy first): see `pdctl.engines.probes`."""

    @abstractmethod
    def reference(self, topology: Topology, tp: int) -> ReferenceSpec:
        """The same engine and model, colocated at `tp`, every flag but disaggregation."""

    def cores(self, topology: Topology, server: ServerLayout) -> tuple[int, ...]:
        """The cores a server process (and every thread it makes) may run on; () for
        all of them, the default."""
        return ()

    def describe_staging(self, topology: Topology) -> str:
        """How the KV of a TP pair moves, as `pdctl plan` says it (pdctl's staging)."""
        transfer = topology.transfer
        if topology.uses_staging:
            return (
                f"staging on (pool {transfer.staging.pool_size_mb:g} MiB, "
                f"segment {transfer.staging.effective_segment_mb:g} MiB)"
            )
        if not transfer.staging.enabled:
            return "staging disabled"
        return "staging off (equal TP: pages go directly)"

    def describe_serving(self, topology: Topology) -> str:
        """What serving.deterministic asks of this engine, as `pdctl plan` says it."""
        if not topology.serving.deterministic:
            return "deterministic off (serving.deterministic: false): the vendor fast path"
        kernels = "one thread" if topology.device == "cpu" else "Triton products"
        return f"deterministic (serving.deterministic): fixed-order kernels, {kernels}"

    def interpreter(self, topology: Topology) -> str:
        """The interpreter that runs this engine's servers (pdctl's, by default)."""
        return python()

    def requirements(self, topology: Topology, base: Requirements) -> Requirements:
        """What the machine needs besides `base` (the topology's generic needs)."""
        return base

    def environment_checks(self, topology: Topology) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What `pdctl doctor FILE` asks the engine's interpreter: the distributions whose
        versions it reports, and the `module:attribute` imports (the KV connector) that
        must succeed there. None for pdctl's own servers (doctor probes pdctl's env)."""
        return (), ()

    def preparations(self, topology: Topology) -> list[Preparation]:
        """Steps before any server starts (none by default)."""
        return []

    def check(self, topology: Topology) -> Iterator[Issue]:
        """Engine-specific rules; by default, no managed flag in a role's `args` or in
        serving.args, and none of what only pdctl's own servers do."""
        yield from self.flag_issues(topology)
        yield from own_server_issues(topology)

    def model_issues(self, model: ModelPath) -> Iterator[Issue]:
        """model.path's checkpoint: a path that names nothing here is a hub id the engine
        resolves; a local one must hold a config.json whose shape can be read."""
        if self.takes_hub_ids and not model.local.exists():
            return
        yield from checkpoint_issues(model, read_checkpoint_shape)

    def flag_issues(self, topology: Topology) -> Iterator[Issue]:
        """No flag the engine manages in a role's `args` or in serving.args."""
        for role, spec in topology.roles.items():
            yield from managed_flag_issues(("roles", role, "args"), spec.args, self.managed_flags)
        yield from managed_flag_issues(
            ("serving", "args"), topology.serving.args, self.managed_flags
        )


def own_server_issues(topology: Topology) -> Iterator[Issue]:
    """What only pdctl's own servers do (shared devices, a role's own KV pool, faults),
    asked of another engine."""
    for role, spec in topology.roles.items():
        if spec.share_devices:
            yield Issue(
                ("roles", role, "share_devices"),
                f"{topology.engine} runs one rank per device (its collectives need it)",
                "remove share_devices, or use engine: embedded",
            )
        if spec.kv_pool_tokens is not None:
            yield Issue(
                ("roles", role, "kv_pool_tokens"),
                f"applies to pdctl's servers (engine embedded), not {topology.engine}",
                "set serving.kv_pool_tokens: every role of this engine takes it",
            )
    for index, _ in enumerate(topology.faults):
        yield Issue(
            ("faults", index, "name"),
            f"fault injection needs engine: embedded (this topology runs {topology.engine})",
            "faults are implemented in pdctl's own servers",
        )


def encoder_issues(topology: Topology, hint: str) -> Iterator[Issue]:
    """An encoder role where only pdctl's servers can run one."""
    if topology.roles.encoder is not None:
        yield Issue(
            ("roles", "encoder"),
            "pdctl launches encoder (EPD) topologies with the embedded engine only",
            hint,
        )


def managed_flag_issues(
    where: tuple[str, ...], args: list[str], managed: Mapping[str, str]
) -> Iterator[Issue]:
    for position, arg in enumerate(args):
        flag = arg.split("=", 1)[0]
        source = managed.get(flag)
        if source is not None:
            yield Issue(
                (*where, position),
                f"'{flag}' is set by pdctl from {source}",
                f"set {source} in the topology instead",
            )
