"""Router command lines: pdctl's builtin PD router, the real sglang-router or the real
vllm-router.

All take the same shape of arguments (`--prefill URL [BOOTSTRAP_PORT]`, `--decode
URL`). pdctl's servers and SGLang's speak SGLang's flow (bootstrap fields, both sides
at once): the builtin router and sglang-router front either. vLLM's servers speak
vLLM's (prefill first, its `kv_transfer_params` then to decode): the builtin router
with `--pd-flow vllm`, or vllm-router from the engine's environment.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

from pdctl.engines import get_engine
from pdctl.engines.base import engine_python, managed_flag_issues, python
from pdctl.engines.command import Arg, Command, PortSlot, command, flags, host_ref, url
from pdctl.engines.probes import Probe, health, on_http
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
    "--pd-flow": "engine",
    "--vllm-pd-disaggregation": "router.kind",
    "--kv-connector": "transfer.backend",
    "--worker-startup-check-interval": "(pdctl's readiness)",
    "--worker-startup-timeout-secs": "launcher.startup_timeout_s",
}


def router_slots(topology: Topology) -> list[PortSlot]:
    slots = [
        PortSlot(ROUTER, "http", "router HTTP API (the endpoint clients use)", topology.router.port)
    ]
    if topology.router.kind != "builtin":  # their metrics listeners have fixed defaults
        slots.append(PortSlot(ROUTER, "metrics", f"{topology.router.kind} Prometheus metrics"))
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
            workers += ["--prefill", where]
            if "bootstrap" in slots:
                workers.append(Arg((slots["bootstrap"].ref,)))
        elif server.role == "decode":
            workers += ["--decode", where]
        elif server.role == "encoder":
            workers += ["--encoder", where]
    timeout = f"{topology.transfer.timeouts.request_s:g}"
    kind = topology.router.kind
    if kind in ("sglang-router", "vllm-router"):
        timeout = str(math.ceil(topology.transfer.timeouts.request_s))  # they take whole seconds
        head = _vendor_program(topology)
        tail: list[str | Arg] = ["--request-timeout-secs", timeout]
        tail += ["--prometheus-host", Arg((host,)), "--prometheus-port", Arg((extra[0].ref,))]
    else:
        head = [python(), "-m", "pdctl.serve", "--role", "router", "--topology-name", topology.name]
        tail = ["--request-timeout", timeout, "--pd-flow", get_engine(topology.engine).pd_flow]
    args = [*head, *workers, "--host", Arg((host,)), "--port", Arg((http.ref,)), *tail]
    return command(*args, *topology.router.args)


def _vendor_program(topology: Topology) -> list[str | Arg]:
    """sglang-router's or vllm-router's program with its PD switches."""
    if topology.router.kind == "sglang-router":
        return [python(), "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    startup_s = math.ceil(topology.launcher.startup_timeout_s)
    head: list[str | Arg] = [engine_python(topology), "-m", "vllm_router.launch_router"]
    head.append("--vllm-pd-disaggregation")
    # it serves only once every worker answered; asked every 30 s by default
    return head + flags(
        {
            "--kv-connector": topology.transfer.backend,
            "--worker-startup-check-interval": "1",
            "--worker-startup-timeout-secs": str(startup_s),
        }
    )


def router_probes(topology: Topology) -> list[Probe]:
    """/health; pdctl's router then reports both sides healthy in /get_server_info."""
    host = host_ref(topology, ROUTER)
    slots = {slot.name: slot for slot in router_slots(topology)}
    probes = [health(host, slots)]
    if topology.router.kind == "builtin":
        seen = on_http(host, slots, "both sides seen", "/get_server_info")
        probes.append(replace(seen, ready_field="ready"))
    return probes


def router_issues(topology: Topology) -> Iterator[Issue]:
    yield from managed_flag_issues(("router", "args"), topology.router.args, MANAGED_FLAGS)
    if topology.router.kind == "sglang-router" and topology.roles.encoder is not None:
        yield Issue(
            ("router", "kind"),
            "sglang-router does not route encoder (EPD) requests",
            "use router: builtin for topologies with an encoder",
        )
    if topology.router.kind == "vllm-router" and topology.engine != "vllm":
        yield Issue(
            ("router", "kind"),
            f"vllm-router speaks vLLM's PD flow (kv_transfer_params), not {topology.engine}'s",
            "use router: builtin (or sglang-router)",
        )
