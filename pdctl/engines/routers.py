"""Router command lines: pdctl's builtin PD router or the real sglang-router.

Both take the same shape of arguments (`--prefill URL BOOTSTRAP_PORT`, `--decode
URL`), so either can front the servers of either engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from pdctl.engines.base import (
    Arg,
    Command,
    PortSlot,
    command,
    host_ref,
    managed_flag_issues,
    python,
    url,
)
from pdctl.engines.probes import Probe, health
from pdctl.topology.issues import Issue
from pdctl.topology.model import Topology
from pdctl.topology.resolve import ServerLayout

ROUTER = "router"
MANAGED_FLAGS: Mapping[str, str] = {
    "--pd-disaggregation": "router.kind",
    "--prefill": "roles.prefill",
    "--decode": "roles.decode",
    "--encoder": "roles.encoder",
    "--host": "host",
    "--port": "router.port",
    "--role": "router.kind",
    "--request-timeout": "transfer.timeouts.request_s",
    "--request-timeout-secs": "transfer.timeouts.request_s",
    "--prometheus-host": "host",
    "--prometheus-port": "(allocated at launch)",
}


def router_slots(topology: Topology) -> list[PortSlot]:
    slots = [
        PortSlot(ROUTER, "http", "router HTTP API (the endpoint clients use)", topology.router.port)
    ]
    if topology.router.kind == "sglang-router":  # its metrics listener has a fixed default
        slots.append(PortSlot(ROUTER, "metrics", "sglang-router Prometheus metrics"))
    return slots


def router_command(
    topology: Topology, servers: Sequence[tuple[ServerLayout, Mapping[str, PortSlot]]]
) -> Command:
    host = host_ref(topology, "router")
    http, *extra = router_slots(topology)
    workers: list[str | Arg] = []
    for server, slots in servers:
        where = url(host_ref(topology, server.name), slots["http"].ref)
        if server.role == "prefill":
            workers += ["--prefill", where, Arg((slots["bootstrap"].ref,))]
        elif server.role == "decode":
            workers += ["--decode", where]
        elif server.role == "encoder":
            workers += ["--encoder", where]
    if topology.router.kind == "sglang-router":
        head: list[str | Arg] = [
            python(),
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
        ]
        timeout = f"{topology.transfer.timeouts.request_s:g}"
        tail: list[str | Arg] = ["--request-timeout-secs", timeout]
        tail += ["--prometheus-host", Arg((host,)), "--prometheus-port", Arg((extra[0].ref,))]
    else:
        head = [python(), "-m", "pdctl.serve", "--role", "router", "--topology-name", topology.name]
        tail = ["--request-timeout", f"{topology.transfer.timeouts.request_s:g}"]
    args = [*head, *workers, "--host", Arg((host,)), "--port", Arg((http.ref,)), *tail]
    return command(*args, *topology.router.args)


def router_probes(topology: Topology) -> list[Probe]:
    """/health; pdctl's router then reports both sides healthy in /get_server_info."""
    host = host_ref(topology, ROUTER)
    slots = {slot.name: slot for slot in router_slots(topology)}
    probes = [health(host, slots)]
    if topology.router.kind == "builtin":
        seen = Probe("ready", "both sides seen", host, slots["http"].ref, "/get_server_info",
                     ready_field="ready")  # fmt: skip
        probes.append(seen)
    return probes


def router_issues(topology: Topology) -> Iterator[Issue]:
    yield from managed_flag_issues(("router", "args"), topology.router.args, MANAGED_FLAGS)
    if topology.router.kind == "sglang-router" and topology.roles.encoder is not None:
        yield Issue(
            ("router", "kind"),
            "sglang-router does not route encoder (EPD) requests",
            "use router: builtin for topologies with an encoder",
        )
