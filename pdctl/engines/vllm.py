"""The vllm engine: real vLLM servers (`python -m vllm.entrypoints.openai.api_server`).

Each prefill and decode server is a vLLM OpenAI server in the engine's own
environment (`engine_python`) with a KV connector: `transfer.backend: nixl` is
NixlConnector (host buffers on cpu, device buffers on cuda and xpu), `mooncake` is
MooncakeConnector where vLLM runs it (not on cpu); prefill is `kv_producer`, decode
`kv_consumer`. A request goes to prefill with `max_tokens: 1` and
`kv_transfer_params: {do_remote_decode: true}`, then to decode with the parameters
prefill answered (vLLM's own PD flow; both routers speak it). The connector's side
channel is a port allocated per run like every listener; vLLM's caches, sockets and
temporary files go in the server's folder of the run (`<workdir>`), and a local model
is served offline. On cpu every server rank gets cores of its own
(`VLLM_CPU_OMP_THREADS_BIND`): NIXL's UCX progress thread busy-polls a core.

This module renders; it starts nothing and imports no vLLM. What it renders is
checked against vLLM's own parser and environment table in CI
(tests/engines/test_vllm_contract.py); docs/vllm.md has the mapping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, TypedDict

from pdctl.engines.base import REFERENCE, Engine, Preparation, ReferenceSpec, engine_python, python
from pdctl.engines.command import Arg, Command, PortRef, PortSlot, command, flags, host_ref
from pdctl.engines.dialect import CompletionsDialect
from pdctl.engines.probes import Probe, health, on_http
from pdctl.engines.proof import VLLMProof
from pdctl.engines.vllm_env import (
    common_env,
    preset_folder,
    server_cores,
    unless_user_set,
)
from pdctl.engines.vllm_rules import vllm_issues
from pdctl.topology.issues import Issue
from pdctl.topology.model import Topology
from pdctl.topology.resolve import (
    EnvEntry,
    Requirements,
    ServerLayout,
    role_spec,
    servers,
)

SUPPORTED = "0.32.0"  # the release the contract tests check against (scripts/setup_vllm.sh)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
SIDE_CHANNEL_PORT = {
    "nixl": "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "mooncake": "VLLM_MOONCAKE_BOOTSTRAP_PORT",
}
# the slot's name: Mooncake's is a bootstrap server a router asks (vllm-router takes its
# port after prefill's URL, as for SGLang); NIXL's is the connector's own side channel
SIDE_SLOT = {"nixl": "side", "mooncake": "bootstrap"}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
CONNECTOR_MODULES = {  # what `pdctl doctor FILE` imports in the engine's environment
    "nixl": "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector:NixlConnector",
    "mooncake": "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
    ":MooncakeConnector",
}


def model_location(topology: Topology) -> str:
    return str(preset_folder(topology)) if topology.model.uses_preset else str(topology.model.path)


def served_name(topology: Topology) -> str:
    """The model's name in the OpenAI API: the preset's, or the checkpoint folder's."""
    model = topology.model
    return model.preset if model.uses_preset else Path(str(model.path)).name or "model"


class KVTransferConfig(TypedDict, total=False):
    """vLLM's `--kv-transfer-config` (vllm/config/kv_transfer.py), the keys pdctl sets."""

    kv_connector: str
    kv_role: str
    kv_buffer_device: str
    kv_load_failure_policy: str
    kv_connector_extra_config: dict[str, list[str]]


def kv_transfer_config(topology: Topology, role: str) -> str:
    transfer = topology.transfer
    config: KVTransferConfig = {
        "kv_connector": CONNECTORS.get(transfer.backend, transfer.backend),
        "kv_role": KV_ROLES[role],
        "kv_buffer_device": "cpu" if topology.device == "cpu" else topology.device,
        "kv_load_failure_policy": "fail",  # never recompute in silence (verify proves it)
    }
    if transfer.backend == "nixl" and transfer.nixl_backend is not None:
        config["kv_connector_extra_config"] = {"backends": [transfer.nixl_backend]}
    return json.dumps(config, separators=(",", ":"))


class VLLMEngine(Engine):
    name = "vllm"
    dialect = CompletionsDialect()
    proof = VLLMProof()
    workdir = True
    pd_flow = "vllm"
    managed_flags: ClassVar[Mapping[str, str]] = {
        "--model": "model.path / model.preset",
        "--served-model-name": "model",
        "--host": "host",
        "--port": "roles.<role>.port",
        "--tensor-parallel-size": "roles.<role>.tp",
        "-tp": "roles.<role>.tp",
        "--dtype": "model.dtype",
        "--seed": "model.seed",
        "--block-size": "serving.page_size",
        "--max-num-seqs": "serving.max_running_requests",
        "--max-num-batched-tokens": "serving.chunked_prefill_tokens",
        "--num-gpu-blocks-override": "serving.kv_pool_tokens",
        "--max-model-len": "serving.max_model_len",
        "--no-async-scheduling": "serving.overlap",
        "--async-scheduling": "serving.overlap",
        "--enable-prefix-caching": "(verify's prefix-hit pass needs it)",
        "--no-enable-prefix-caching": "(verify's prefix-hit pass needs it)",
        "--enable-prompt-tokens-details": "(verify reads cached tokens)",
        "--kv-transfer-config": "transfer.backend",
    }

    def port_slots(self, topology: Topology, server: ServerLayout) -> list[PortSlot]:
        spec = role_spec(topology, server.role)
        slots = [PortSlot(server.name, "http", "HTTP API (OpenAI)", spec.port)]
        backend = topology.transfer.backend
        if backend in SIDE_CHANNEL_PORT:
            slots.append(
                PortSlot(server.name, SIDE_SLOT[backend], f"{CONNECTORS[backend]} side channel")
            )
        return slots

    def probes(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> list[Probe]:
        """/health once the engine core is up; /v1/models once the API serves the model.
        The connector's side channel speaks ZMQ, not HTTP: the canary through the router
        is what proves PD."""
        host = host_ref(topology, server.name)
        return [health(host, slots), on_http(host, slots, "model served", "/v1/models")]

    def command(
        self, topology: Topology, server: ServerLayout, slots: Mapping[str, PortSlot]
    ) -> Command:
        host = host_ref(topology, server.name)
        pd: list[str | Arg] = ["--kv-transfer-config", kv_transfer_config(topology, server.role)]
        args = _server_args(topology, host, slots["http"].ref, server.tp, pd)
        return command(*args, *role_spec(topology, server.role).args)

    def env(self, topology: Topology, server: ServerLayout) -> list[EnvEntry]:
        entries = common_env(topology, server_cores(topology, server.name))
        backend = topology.transfer.backend
        if backend in SIDE_CHANNEL_PORT:
            side = f"<{server.name}.{SIDE_SLOT[backend]}>"
            entries.append(EnvEntry(SIDE_CHANNEL_PORT[backend], side, "(allocated at launch)"))
        if backend == "nixl":
            entries.append(EnvEntry("VLLM_NIXL_SIDE_CHANNEL_HOST", topology.host, "host"))
        if backend == "mooncake":
            timeout = f"{topology.transfer.timeouts.transfer_s:g}"
            entries.append(
                EnvEntry("VLLM_MOONCAKE_CONNECTOR_TIMEOUT", timeout, "transfer.timeouts.transfer_s")
            )
        return unless_user_set(topology, server.role, entries)

    def cores(self, topology: Topology, server: ServerLayout) -> tuple[int, ...]:
        """On cpu, the server's cores, for the whole process: UCX's progress thread then
        spins on them, not on another server's (or on pdctl's)."""
        ranks = server_cores(topology, server.name) or ()
        return tuple(core for cores in ranks for core in cores)

    def reference(self, topology: Topology, tp: int) -> ReferenceSpec:
        """A colocated vLLM server: the same model, serving flags and serving.args, no KV
        connector, on the first prefill server's cores (it runs beside the PD passes
        after the first, when a serial PD request leaves one role idle)."""
        slot = PortSlot(REFERENCE, "http", "colocated reference server")
        host = PortRef(f"{REFERENCE}.host", topology.host)
        args = _server_args(topology, host, slot.ref, tp, [])
        by_name = {"http": slot}
        probes = (health(host, by_name), on_http(host, by_name, "model served", "/v1/models"))
        cores = self.cores(topology, servers(topology)[0])
        ranks = tuple(cores[rank::tp] for rank in range(tp)) if len(cores) >= tp else None
        env = unless_user_set(topology, "prefill", common_env(topology, ranks))
        return ReferenceSpec((slot,), command(*args), probes, tuple(env), cores)

    def interpreter(self, topology: Topology) -> str:
        return engine_python(topology)

    def requirements(self, topology: Topology, base: Requirements) -> Requirements:
        modules = ["vllm"]
        reasons = dict(base.reasons)
        reasons["vllm"] = "engine: vllm"
        if topology.transfer.backend == "nixl":
            modules.append("nixl")
            reasons["nixl"] = "transfer.backend: nixl (vLLM's NixlConnector)"
        elif topology.transfer.backend == "mooncake":
            modules.append("mooncake.engine")
            reasons["mooncake.engine"] = "transfer.backend: mooncake (vLLM's MooncakeConnector)"
        if topology.router.kind == "vllm-router":
            modules.append("vllm_router")
            reasons["vllm_router"] = "router: vllm-router"
        cores = 0
        if topology.device == "cpu":
            cores = sum(server.tp for server in servers(topology))
            reasons[f"cpu_cores={cores}"] = "a core of its own for every server rank"
        return replace(
            base,
            reasons=reasons,
            python=engine_python(topology),
            engine_modules=tuple(modules),
            cpu_cores=cores,
        )

    def describe_staging(self, topology: Topology) -> str:
        connector = CONNECTORS.get(topology.transfer.backend, topology.transfer.backend)
        return f"vLLM's {connector} (no staging: it maps TP layouts itself)"

    def describe_serving(self, topology: Topology) -> str:
        if topology.serving.deterministic:
            return "deterministic (serving.deterministic): VLLM_BATCH_INVARIANT=1"
        return super().describe_serving(topology)

    def environment_checks(self, topology: Topology) -> tuple[tuple[str, ...], tuple[str, ...]]:
        distributions = ("vllm-cpu", "vllm", "torch", "nixl-cu12", "nixl-cu13", "vllm-router")
        connector = CONNECTOR_MODULES.get(topology.transfer.backend)
        return distributions, (connector,) if connector else ()

    def preparations(self, topology: Topology) -> list[Preparation]:
        if not topology.model.uses_preset:
            return []
        model, folder = topology.model, preset_folder(topology)
        stamp = {"preset": model.preset, "seed": model.seed, "dtype": topology.effective_dtype}
        argv = (
            *(python(), "-m", "pdctl.serve.export"),
            *("--preset", model.preset),
            *("--seed", str(model.seed)),
            *("--dtype", topology.effective_dtype),
            str(folder),
        )
        return [
            Preparation(
                f"the {model.preset} preset (seed {model.seed}) as a checkpoint in {folder}",
                argv,
                str(folder / "pdctl-export.json"),
                json.dumps({**stamp, "format": 1}, indent=1),
            )
        ]

    def check(self, topology: Topology) -> Iterator[Issue]:
        yield from super().check(topology)
        yield from vllm_issues(topology)


def _server_args(
    topology: Topology, host: PortRef, port: PortRef, tp: int, pd: list[str | Arg]
) -> list[str | Arg]:
    serving = topology.serving
    args: list[str | Arg] = [engine_python(topology), "-m", SERVER_MODULE]
    args += flags(
        {
            "--model": model_location(topology),
            "--served-model-name": served_name(topology),
            "--host": host,
            "--port": port,
            "--tensor-parallel-size": str(tp),
            "--dtype": topology.effective_dtype,
            "--seed": str(topology.model.seed),
            "--block-size": str(serving.page_size),
            "--max-num-seqs": str(serving.max_running_requests),
            "--max-num-batched-tokens": str(serving.chunked_prefill_tokens),
        }
    )
    args += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    if serving.max_model_len is not None:
        args += ["--max-model-len", str(serving.max_model_len)]
    if serving.kv_pool_tokens is not None:
        blocks = math.ceil(serving.kv_pool_tokens / serving.page_size)
        args += ["--num-gpu-blocks-override", str(blocks)]
    if not serving.overlap:
        args.append("--no-async-scheduling")
    return [*args, *pd, *serving.args]
