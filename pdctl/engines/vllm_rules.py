"""What a topology may ask of vLLM, checked before anything starts (`VLLMEngine.check`).

Each refusal says what vLLM 0.32 does instead, as measured on the machines here
(docs/vllm.md): its MooncakeConnector asks torch for an accelerator, its
batch-invariant mode fails the first request on cpu, it has no transport called tcp.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

from pdctl.engines.base import encoder_issues
from pdctl.topology.issues import Issue
from pdctl.topology.model import Topology


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def vllm_issues(topology: Topology) -> Iterator[Issue]:
    yield from _transfer(topology)
    if topology.device == "cpu" and topology.serving.deterministic:
        yield Issue(
            ("serving", "deterministic"),
            "vLLM 0.32 has no batch-invariant mode on cpu: with VLLM_BATCH_INVARIANT=1 its "
            "first request fails (its batch-invariant kernels are Triton kernels for CUDA "
            "and XPU)",
            "set serving.deterministic: false; verify then reports engine numerics (after "
            "the control before blame) without failing on them",
        )
    yield from encoder_issues(topology, "remove the encoder role, or use engine: embedded")
    if topology.launcher.kind != "local":
        yield Issue(
            ("launcher", "kind"),
            "engine vllm is launched on this host only (launcher: local)",
            "use launcher: local; vLLM spreads a server over nodes with its own Ray backend",
        )
    if topology.router.kind == "sglang-router":
        yield Issue(
            ("router", "kind"),
            "sglang-router speaks SGLang's bootstrap flow, not vLLM's kv_transfer_params",
            "use router: builtin or router: vllm-router",
        )
    if not _loopback(topology.host):
        yield Issue(
            ("host",),
            "vLLM servers run with VLLM_SERVER_DEV_MODE=1 (verify empties their prefix caches "
            "through it), which also serves development endpoints to whoever reaches them",
            "keep host on loopback, or on a network you trust",
            severity="warning",
        )


def _transfer(topology: Topology) -> Iterator[Issue]:
    transfer = topology.transfer
    if transfer.backend == "tcp":
        yield Issue(
            ("transfer", "backend"),
            "vLLM has no connector for 'tcp' (pdctl's builtin transport)",
            "use nixl (vLLM's NixlConnector; UCX on host memory works on cpu), or mooncake "
            "on an accelerator",
        )
    elif transfer.backend == "mooncake" and topology.router.kind == "builtin":
        yield Issue(
            ("router", "kind"),
            "pdctl's builtin router speaks vLLM's NixlConnector flow (prefill answers the "
            "kv_transfer_params decode needs); MooncakeConnector's flow needs the router to "
            "ask each prefill's bootstrap server for its engine id and give both sides a "
            "transfer id",
            "use router: vllm-router with transfer.backend: mooncake",
        )
    if transfer.backend == "mooncake" and topology.device == "cpu":
        yield Issue(
            ("transfer", "backend"),
            "vLLM 0.32's MooncakeConnector needs an accelerator (it asks "
            "torch.accelerator.current_device_index(), which fails on a CPU-only machine)",
            "use transfer.backend: nixl on cpu",
        )
    explicit = transfer.staging.model_fields_set
    if explicit:
        key = sorted(explicit)[0]
        yield Issue(
            ("transfer", "staging", key),
            "transfer.staging is pdctl's and SGLang's: vLLM's connectors move KV between TP "
            "layouts themselves",
            "remove transfer.staging",
            severity="warning",
        )
