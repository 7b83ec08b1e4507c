"""A server's command line and environment values with their ports still symbolic.

Ports are allocated only at launch, so a command is built from `Arg`s whose parts may
be `PortRef`s: a plan shows `<prefill-0.http>` where a port goes and the launcher renders
the real number. This module knows no engine and starts nothing.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from pdctl.topology.model import Topology

WORKDIR = "<workdir>"  # in an environment value: the process's own folder in the run
PLACEHOLDER = re.compile(r"<([A-Za-z0-9_.-]+)>")


@dataclass(frozen=True)
class PortRef:
    key: str  # "<owner>.<slot>", e.g. "prefill-0.bootstrap"; "<owner>.host" for its address
    default: str | None = None  # hosts: the topology's host unless the launcher says otherwise

    def render(self, ports: Mapping[str, int | str] | None) -> str:
        if ports and self.key in ports:
            return str(ports[self.key])
        if self.default is not None:
            return self.default
        return f"<{self.key}>"


def host_ref(topology: Topology, owner: str) -> PortRef:
    """The address `owner` listens on: the topology's host, or (launcher ray) its node's."""
    return PortRef(f"{owner}.host", topology.host)


@dataclass(frozen=True)
class Arg:
    """One command-line argument, possibly with ports still to be filled in."""

    parts: tuple[str | PortRef, ...]

    def render(self, ports: Mapping[str, int | str] | None = None) -> str:
        return "".join(p if isinstance(p, str) else p.render(ports) for p in self.parts)


Command = tuple[Arg, ...]


def command(*items: str | PortRef | Arg) -> Command:
    return tuple(item if isinstance(item, Arg) else Arg((item,)) for item in items)


def flags(pairs: Mapping[str, str | PortRef | Arg]) -> list[str | Arg]:
    """Flags with their values, in the mapping's order: `flags({"--seed": "0", "--port":
    ref})` is `["--seed", "0", "--port", Arg((ref,))]`. A flag without a value stays a
    plain string where it is listed."""
    args: list[str | Arg] = []
    for flag, value in pairs.items():
        args += [flag, Arg((value,)) if isinstance(value, PortRef) else value]
    return args


def url(host: str | PortRef, port: PortRef) -> Arg:
    return Arg(("http://", host, ":", port))


def joined(refs: list[PortRef], separator: str = ",") -> Arg:
    """Several ports in one argument: `<a>,<b>`."""
    parts: list[str | PortRef] = []
    for ref in refs:
        parts += [separator, ref] if parts else [ref]
    return Arg(tuple(parts))


def render_command(cmd: Command, ports: Mapping[str, int | str] | None = None) -> list[str]:
    return [arg.render(ports) for arg in cmd]


def shell_line(cmd: Command, ports: Mapping[str, int | str] | None = None) -> str:
    return shlex.join(render_command(cmd, ports))


@dataclass(frozen=True)
class PortSlot:
    """A listener a process needs; `fixed` when the topology pins it."""

    owner: str
    name: str
    purpose: str
    fixed: int | None = None

    @property
    def key(self) -> str:
        return f"{self.owner}.{self.name}"

    @property
    def ref(self) -> PortRef:
        return PortRef(self.key)


def render_value(value: str, values: Mapping[str, int | str]) -> str:
    """An environment value with its `<owner.slot>` ports (and `<workdir>`) filled in
    from `values`; placeholders it does not know stay as written (a plan shows them)."""
    return PLACEHOLDER.sub(lambda m: str(values.get(m.group(1), m.group(0))), value)
