"""Readiness probes: how the launcher tells that a server of an engine can serve.

Each engine (and router) declares, per server, the HTTP checks that say it is up,
on its own endpoints: pdctl's servers answer `/bootstrap/info` on prefill's
bootstrap port, SGLang's bootstrap server answers `/health` there and its HTTP
server `/server_info`. The launcher runs them in order (`launch/readiness.py`) and
ends, as always, with a 1-token canary through the router; `pdctl plan` lists them.
Probes carry ports as `PortRef`s, like commands, so a plan shows where they go.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdctl.engines.command import Arg, PortRef, PortSlot


@dataclass(frozen=True)
class Probe:
    """One GET a server must answer with 200 before it counts as `stage`."""

    stage: str  # healthy | ready
    what: str  # what it shows: "health", "role ready", "bootstrap up", "both sides seen"
    host: PortRef
    port: PortRef
    path: str
    auth: bool = False  # sends the per-run secret as a bearer token
    ready_field: str | None = None  # the JSON answer must have this field true

    def url(self, ports: Mapping[str, int | str] | None = None) -> str:
        return Arg(("http://", self.host, ":", self.port, self.path)).render(ports)

    def describe(self, ports: Mapping[str, int | str] | None = None) -> str:
        extra = f", {self.ready_field} true" if self.ready_field else ""
        extra += ", with the run's secret" if self.auth else ""
        return f"{self.stage}: GET {self.url(ports)} ({self.what}{extra})"


def health(host: PortRef, slots: Mapping[str, PortSlot], path: str = "/health") -> Probe:
    return Probe("healthy", "health", host, slots["http"].ref, path)


def on_http(host: PortRef, slots: Mapping[str, PortSlot], what: str, path: str) -> Probe:
    return Probe("ready", what, host, slots["http"].ref, path)
