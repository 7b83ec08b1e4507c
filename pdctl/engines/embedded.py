"""The embedded engine: pdctl's own servers (`python -m pdctl.serve`).

Every topology key reaches the server as an explicit flag, so a command line from
`pdctl plan` can be run by hand. With the builtin tcp transport each rank gets its
own listener port; Mooncake's P2P handshake binds a port of its own choosing and
NIXL needs none (its agent metadata travels in the bootstrap exchange), so those
ranks get no transport port. A server with tp > 1 also gets a rendezvous port.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import ClassVar

from pdctl.core import encoder_tp_problem, read_checkpoint_config, supported_checkpoints
from pdctl.engines.base import REFERENCE, Engine, ReferenceSpec, base_slots, python
from pdctl.engines.checkpoint import ModelPath, checkpoint_issues
from pdctl.engines.command import (
    Arg,
    Command,
    PortRef,
    PortSlot,
    command,
    flags,
    host_ref,
    joined,
)
from pdctl.engines.probes import Probe, health, on_http
from pdctl.topology.issues import Issue
from pdctl.topology.model import Topology
from pdctl.topology.resolve import (
    Requirements,
    ServerLayout,
    requirements,
    role_spec,
    transport_needs,
)


def _mb(value: float) -> str:
    return f"{value:g}"


def model_args(topology: Topology, kv_pool_tokens: int | None = None) -> list[str | Arg]:
    """Device, model and serving flags: the same for every role (and the reference), but
    a role's own KV pool (`kv_pool_tokens`, else the topology's)."""
    model, serving = topology.model, topology.serving
    pool = kv_pool_tokens if kv_pool_tokens is not None else serving.kv_pool_tokens
    args: list[str | Arg] = ["--device", topology.device]
    if model.uses_preset:
        args += ["--model-preset", model.preset]
    else:
        args += ["--model-path", str(model.path)]
    args += flags(
        {
            "--dtype": topology.effective_dtype,
            "--seed": str(model.seed),
            "--page-size": str(serving.page_size),
            "--max-running-requests": str(serving.max_running_requests),
            "--chunked-prefill-tokens": str(serving.chunked_prefill_tokens),
        }
    )
    if pool is not None:
        args += ["--kv-pool-tokens", str(pool)]
    if not serving.overlap:
        args.append("--disable-overlap")
    args.append("--deterministic" if serving.deterministic else "--no-deterministic")
    return [*args, *serving.args]


class EmbeddedEngine(Engine):
    name = "embedded"
    own_servers = True
    takes_hub_ids = False  # pdctl's servers read local checkpoints only
    managed_flags: ClassVar[Mapping[str, str]] = {
        "--role": "roles",
        "--topology-name": "name",
        "--replica": "roles.<role>.replicas",
        "--host": "host",
        "--port": "roles.<role>.port",
        "--tp": "roles.<role>.tp",
        "--dist-port": "(allocated at launch)",
        "--device": "device",
        "--model-preset": "model.preset",
        "--model-path": "model.path",
        "--dtype": "model.dtype",
        "--seed": "model.seed",
        "--page-size": "serving.page_size",
        "--max-running-requests": "serving.max_running_requests",
        "--chunked-prefill-tokens": "serving.chunked_prefill_tokens",
        "--kv-pool-tokens": "serving.kv_pool_tokens (roles.<role>.kv_pool_tokens)",
        "--disable-overlap": "serving.overlap",
        "--deterministic": "serving.deterministic",
        "--no-deterministic": "serving.deterministic",
        "--rank-devices": "roles.<role>.devices",
        "--transfer-backend": "transfer.backend",
        "--transport-ports": "(allocated at launch)",
        "--mooncake-protocol": "transfer.protocol",
        "--ib-device": "transfer.ib_devices",
        "--nixl-backend": "transfer.nixl_backend",
        "--staging": "transfer.staging.enabled",
        "--no-staging": "transfer.staging.enabled",
        "--staging-pool-mb": "transfer.staging.pool_size_mb",
        "--staging-segment-mb": "transfer.staging.segment_size_mb",
        "--bootstrap-port": "roles.prefill.bootstrap_port",
        "--connect-timeout": "transfer.timeouts.connect_s",
        "--bootstrap-timeout": "transfer.timeouts.bootstrap_s",
        "--transfer-timeout": "transfer.timeouts.transfer_s",
    }

    def model_issues(self, model: ModelPath) -> Iterator[Issue]:
        """The checkpoint through the embedded engine's own reader (its loader's): what
        it cannot compute is refused here, not when the server starts."""
        runs = supported_checkpoints()
        hint = f"the embedded engine runs {runs}; engines sglang and vllm run many more"
        yield from checkpoint_issues(model, read_checkpoint_config, hint)

    def check(self, topology: Topology) -> Iterator[Issue]:
        """Managed flags, and what pdctl's servers take differently from other engines:
        the model's own positions, the encoder of the presets with its heads."""
        yield from self.flag_issues(topology)
        if topology.serving.max_model_len is not None:
            yield Issue(
                ("serving", "max_model_len"),
                "applies to engines sglang and vllm; pdctl's servers take the model's positions",
                "remove serving.max_model_len",
            )
        encoder = topology.roles.encoder
        if encoder is None:
            return
        if not topology.model.uses_preset:
            yield Issue(
                ("roles", "encoder"),
                "the embedded encoder runs with preset models only",
                "use model.preset; pdctl's encoder model is part of the presets",
            )
        problem = encoder_tp_problem(encoder.tp)
        if problem:
            yield Issue(("roles", "encoder", "tp"), problem)

    def requirements(self, topology: Topology, base: Requirements) -> Requirements:
        """pdctl's servers import the transport in pdctl's interpreter: the derivation of
        `base` again, with the transport's modules and capabilities where `requirements`
        puts what an engine imports there (before the router's and launcher's)."""
        return requirements(topology, transport_needs(topology))

    def port_slots(self, topology: Topology, server: ServerLayout) -> list[PortSlot]:
        slots = base_slots(topology, server)
        if server.tp > 1:
            slots.append(PortSlot(server.name, "dist", "torch.distributed rendezvous"))
        if topology.transfer.backend == "tcp":
            for rank in range(server.tp):
                slots.append(
                    PortSlot(server.name, f"transport.tp{rank}", f"tcp transport, rank {rank}")
                )
        return slots

    def reference(self, topology: Topology, tp: int) -> ReferenceSpec:
        slots = [PortSlot(REFERENCE, "http", "colocated reference server")]
        if tp > 1:
            slots.append(PortSlot(REFERENCE, "dist", "reference rendezvous"))
        args: list[str | Arg] = [python(), "-m", "pdctl.serve"]
        args += flags(
            {
                "--role": "colocated",
                "--topology-name": topology.name,
                "--host": topology.host,
                "--port": slots[0].ref,
                "--tp": str(tp),
            }
        )
        if tp > 1:
            args += ["--dist-port", Arg((slots[1].ref,))]
        args += model_args(topology)
        host = PortRef(f"{REFERENCE}.host", topology.host)
        by_name = {slot.name: slot for slot in slots}
        return ReferenceSpec(tuple(slots), command(*args), (health(host, by_name),))

    def probes(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> list[Probe]:
        """/health; then prefill's bootstrap endpoint (authenticated), or the others' info."""
        host = host_ref(topology, server.name)
        if server.role == "prefill":
            bootstrap = slots["bootstrap"].ref
            up = Probe("ready", "bootstrap up", host, bootstrap, "/bootstrap/info", auth=True)
            return [health(host, slots), up]
        return [health(host, slots), on_http(host, slots, "role ready", "/get_server_info")]

    def command(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> Command:
        transfer = topology.transfer
        args: list[str | Arg] = [python(), "-m", "pdctl.serve"]
        args += flags(
            {
                "--role": server.role,
                "--topology-name": topology.name,
                "--replica": str(server.replica),
                "--host": host_ref(topology, server.name),
                "--port": slots["http"].ref,
                "--tp": str(server.tp),
            }
        )
        if "dist" in slots:
            args += ["--dist-port", Arg((slots["dist"].ref,))]
        if server.shares_devices:  # ranks on one device: each rank's index in the mask
            args += ["--rank-devices", ",".join(str(i) for i in server.local_devices)]
        args += model_args(topology, role_spec(topology, server.role).kv_pool_tokens)
        args += ["--transfer-backend", transfer.backend]
        if transfer.backend == "tcp":
            transport = [slots[f"transport.tp{rank}"].ref for rank in range(server.tp)]
            args += ["--transport-ports", joined(transport)]
        if transfer.backend == "mooncake":
            args += ["--mooncake-protocol", transfer.effective_protocol]
            for device in transfer.ib_devices:
                args += ["--ib-device", device]
        if transfer.backend == "nixl":
            args += ["--nixl-backend", transfer.nixl_backend or "UCX"]
        if topology.uses_staging:
            staging = transfer.staging
            args.append("--staging")
            args += flags(
                {
                    "--staging-pool-mb": _mb(staging.pool_size_mb),
                    "--staging-segment-mb": _mb(staging.effective_segment_mb),
                }
            )
        else:
            args.append("--no-staging")
        if "bootstrap" in slots:
            args += ["--bootstrap-port", Arg((slots["bootstrap"].ref,))]
        timeouts = transfer.timeouts
        args += flags(
            {
                "--connect-timeout": f"{timeouts.connect_s:g}",
                "--bootstrap-timeout": f"{timeouts.bootstrap_s:g}",
                "--transfer-timeout": f"{timeouts.transfer_s:g}",
            }
        )
        args += role_spec(topology, server.role).args
        return command(*args)
