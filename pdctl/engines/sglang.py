"""The sglang engine: real SGLang servers (`python -m sglang.launch_server`).

SGLang cannot run on a CPU-only CI machine, so these command lines are checked by
plan snapshots; topologies that use them require `sglang` to be importable and
skip cleanly elsewhere. Device visibility comes from the environment, so every
server starts at `--base-gpu-id 0` inside its own device mask.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import ClassVar

from pdctl.engines.base import (
    REFERENCE,
    Engine,
    ReferenceSpec,
    base_slots,
    encoder_issues,
    engine_python,
)
from pdctl.engines.command import Arg, Command, PortRef, PortSlot, command, flags, host_ref
from pdctl.engines.probes import Probe, health, on_http
from pdctl.engines.proof import SGLangProof
from pdctl.topology.issues import Issue
from pdctl.topology.model import Topology
from pdctl.topology.resolve import (
    EnvEntry,
    Requirements,
    ServerLayout,
    merged_user_env,
    role_spec,
)

SUPPORTED = "0.5.23"  # the release the contract tests check against (tests/engines)


class SGLangEngine(Engine):
    name = "sglang"
    proof = SGLangProof()
    managed_flags: ClassVar[Mapping[str, str]] = {
        "--model-path": "model.path",
        "--host": "host",
        "--port": "roles.<role>.port",
        "--tp": "roles.<role>.tp",
        "--tp-size": "roles.<role>.tp",
        "--base-gpu-id": "roles.<role>.devices",
        "--device": "device",
        "--dist-init-addr": "(allocated at launch)",
        "--nccl-port": "(allocated at launch)",
        "--disaggregation-mode": "roles",
        "--disaggregation-transfer-backend": "transfer.backend",
        "--disaggregation-bootstrap-port": "roles.prefill.bootstrap_port",
        "--disaggregation-ib-device": "transfer.ib_devices",
        "--page-size": "serving.page_size",
        "--max-running-requests": "serving.max_running_requests",
        "--chunked-prefill-size": "serving.chunked_prefill_tokens",
        "--max-total-tokens": "serving.kv_pool_tokens",
        "--disable-overlap-schedule": "serving.overlap",
        "--dtype": "model.dtype",
        "--random-seed": "model.seed",
        "--enable-deterministic-inference": "serving.deterministic",
        "--context-length": "serving.max_model_len",
        "--enable-metrics": "(verify reads the transfer counters)",
    }

    def port_slots(self, topology: Topology, server: ServerLayout) -> list[PortSlot]:
        slots = base_slots(topology, server)
        slots.append(PortSlot(server.name, "nccl", "NCCL / collective init port"))
        if server.tp > 1:
            slots.append(PortSlot(server.name, "dist", "torch.distributed init address"))
        return slots

    def probes(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> list[Probe]:
        """SGLang's own endpoints: its HTTP server's /health and /server_info, and on
        prefill its bootstrap server's /health (sglang/srt/disaggregation/common/conn.py),
        which answers once the KV manager started it. SGLang 0.5.23 lists no registered
        decode ranks there, so the canary through the router is what proves PD."""
        host = host_ref(topology, server.name)
        probes = [health(host, slots), on_http(host, slots, "role ready", "/server_info")]
        if server.role == "prefill":
            bootstrap = slots["bootstrap"].ref
            probes.append(Probe("ready", "bootstrap up", host, bootstrap, "/health"))
        return probes

    def command(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> Command:
        transfer = topology.transfer
        host = host_ref(topology, server.name)
        pd = flags(
            {
                "--disaggregation-mode": server.role,
                "--disaggregation-transfer-backend": transfer.backend,
            }
        )
        if "bootstrap" in slots:
            pd += ["--disaggregation-bootstrap-port", Arg((slots["bootstrap"].ref,))]
        if transfer.ib_devices:
            pd += ["--disaggregation-ib-device", ",".join(transfer.ib_devices)]
        args = _server_args(topology, host, slots, server.tp, pd)
        return command(*args, *role_spec(topology, server.role).args)

    def reference(self, topology: Topology, tp: int) -> ReferenceSpec:
        """A colocated SGLang server: the same model and serving flags, no disaggregation
        (and no role's `args`, which may carry PD-only flags)."""
        slots = [
            PortSlot(REFERENCE, "http", "colocated reference server"),
            PortSlot(REFERENCE, "nccl", "NCCL / collective init port"),
        ]
        if tp > 1:
            slots.append(PortSlot(REFERENCE, "dist", "torch.distributed init address"))
        by_name = {slot.name: slot for slot in slots}
        host = PortRef(f"{REFERENCE}.host", topology.host)
        args = _server_args(topology, host, by_name, tp, [])
        probes = (health(host, by_name), on_http(host, by_name, "role ready", "/server_info"))
        return ReferenceSpec(tuple(slots), command(*args), probes)

    def env(self, topology: Topology, server: ServerLayout) -> list[EnvEntry]:
        transfer = topology.transfer
        entries: list[EnvEntry] = []
        if topology.uses_staging:
            staging = transfer.staging
            source = "transfer.staging"
            entries += [
                EnvEntry("SGLANG_DISAGG_STAGING_BUFFER", "1", source),
                EnvEntry(
                    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB",
                    str(math.ceil(staging.pool_size_mb)),
                    source,
                ),
            ]
        user = merged_user_env(topology, server.role)
        if transfer.backend == "mooncake" and "MOONCAKE_PROTOCOL" not in user:
            entries.append(
                EnvEntry("MOONCAKE_PROTOCOL", transfer.effective_protocol, "transfer.protocol")
            )
        if transfer.backend == "nixl":
            plugin = transfer.nixl_backend or "UCX"
            entries.append(
                EnvEntry("SGLANG_DISAGGREGATION_NIXL_BACKEND", plugin, "transfer.nixl_backend")
            )
        timeouts = transfer.timeouts
        entries += [
            EnvEntry(
                "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
                f"{math.ceil(timeouts.bootstrap_s)}",
                "transfer.timeouts.bootstrap_s",
            ),
            EnvEntry(
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                f"{math.ceil(timeouts.transfer_s)}",
                "transfer.timeouts.transfer_s",
            ),
        ]
        return entries

    def interpreter(self, topology: Topology) -> str:
        return engine_python(topology)

    def requirements(self, topology: Topology, base: Requirements) -> Requirements:
        """SGLang and its transfer engine importable by the engine's interpreter."""
        modules, reasons = ["sglang"], {**base.reasons, "sglang": "engine: sglang"}
        if topology.transfer.backend in ("mooncake", "nixl"):
            module = "mooncake.engine" if topology.transfer.backend == "mooncake" else "nixl"
            modules.append(module)
            reasons[module] = f"transfer.backend: {topology.transfer.backend}"
        python = engine_python(topology)
        return replace(base, reasons=reasons, python=python, engine_modules=tuple(modules))

    def describe_staging(self, topology: Topology) -> str:
        if topology.uses_staging:  # SGLang sizes its own writes
            return f"staging on (SGLang's pool {topology.transfer.staging.pool_size_mb:g} MiB)"
        return super().describe_staging(topology)

    def describe_serving(self, topology: Topology) -> str:
        if topology.serving.deterministic:
            return "deterministic (serving.deterministic): --enable-deterministic-inference"
        return super().describe_serving(topology)

    def environment_checks(self, topology: Topology) -> tuple[tuple[str, ...], tuple[str, ...]]:
        distributions = ("sglang", "sglang-router", "mooncake-transfer-engine", "nixl")
        return distributions, ("sglang.srt.server_args:ServerArgs",)

    def check(self, topology: Topology) -> Iterator[Issue]:
        yield from super().check(topology)
        if topology.model.uses_preset:
            yield Issue(
                ("model",),
                f"engine sglang cannot run pdctl's built-in '{topology.model.preset}' preset",
                "set model.path to a checkpoint directory or a Hugging Face hub id",
            )
        if topology.transfer.backend == "tcp":
            yield Issue(
                ("transfer", "backend"),
                "SGLang has no 'tcp' transfer backend (tcp is pdctl's builtin transport)",
                "use mooncake with protocol: tcp (no RDMA NIC needed) or nixl",
            )
        if topology.transfer.staging.segment_size_mb is not None:
            yield Issue(
                ("transfer", "staging", "segment_size_mb"),
                f"SGLang {SUPPORTED} sizes its staging writes itself: it has no setting for "
                "the segment size (pdctl's servers only)",
                "remove segment_size_mb; transfer.staging.pool_size_mb sets SGLang's pool",
            )
        yield from encoder_issues(
            topology, "use engine: embedded, or run the SGLang encoder outside pdctl"
        )


def _server_args(
    topology: Topology,
    host: PortRef,
    slots: Mapping[str, PortSlot],
    tp: int,
    pd: list[str | Arg],
) -> list[str | Arg]:
    """`sglang.launch_server` with the topology's model and serving flags; `pd` (the
    disaggregation flags) goes right after the listener."""
    serving = topology.serving
    args: list[str | Arg] = [engine_python(topology), "-m", "sglang.launch_server"]
    args += flags(
        {
            "--model-path": str(topology.model.path),
            "--host": host,
            "--port": slots["http"].ref,
        }
    )
    args += pd
    args += flags(
        {
            "--tp-size": str(tp),
            "--base-gpu-id": "0",
            "--device": topology.device,
            "--nccl-port": slots["nccl"].ref,
        }
    )
    if "dist" in slots:
        args += ["--dist-init-addr", Arg((host, ":", slots["dist"].ref))]
    args += flags(
        {
            "--page-size": str(serving.page_size),
            "--max-running-requests": str(serving.max_running_requests),
            "--chunked-prefill-size": str(serving.chunked_prefill_tokens),
        }
    )
    if serving.kv_pool_tokens is not None:
        args += ["--max-total-tokens", str(serving.kv_pool_tokens)]
    if not serving.overlap:
        args.append("--disable-overlap-schedule")
    if serving.deterministic:
        args.append("--enable-deterministic-inference")
    if topology.model.dtype != "auto":
        args += ["--dtype", topology.model.dtype]
    if serving.max_model_len is not None:
        args += ["--context-length", str(serving.max_model_len)]
    args += ["--random-seed", str(topology.model.seed), "--enable-metrics"]
    return [*args, *serving.args]
