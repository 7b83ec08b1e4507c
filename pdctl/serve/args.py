"""Command-line arguments of `python -m pdctl.serve` (what `pdctl plan` prints).

Every flag maps to a topology key (see `pdctl.engines.embedded`); the server reads
them once here into a frozen `ServerArgs`; the server's tunables are the rows of
`serve/settings.py`, parsed here into `ServerArgs.settings`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from pdctl.serve.settings import ServeSettings, add_arguments, from_namespace
from pdctl.titles import role_name


@dataclass(frozen=True)
class ServerArgs:
    role: str
    topology_name: str
    replica: int
    host: str
    port: int
    tp: int
    tp_rank: int
    dist_port: int | None
    device: str
    model_preset: str | None
    model_path: str | None
    dtype: str
    seed: int
    page_size: int
    max_running_requests: int
    chunked_prefill_tokens: int
    kv_pool_tokens: int | None
    overlap: bool
    transfer_backend: str
    transport_ports: tuple[int, ...]
    mooncake_protocol: str
    ib_devices: tuple[str, ...]
    nixl_backend: str
    staging: bool
    staging_pool_mb: float
    staging_segment_mb: float
    bootstrap_port: int | None
    connect_timeout: float
    bootstrap_timeout: float
    transfer_timeout: float
    prefill: tuple[tuple[str, int | None], ...] = field(default_factory=tuple)
    decode: tuple[str, ...] = field(default_factory=tuple)
    encoder: tuple[str, ...] = field(default_factory=tuple)
    request_timeout: float = 120.0
    pd_flow: str = "bootstrap"  # router: bootstrap (pdctl's and SGLang's servers) or vllm
    embedding_pool_mb: float = 16.0
    deterministic: bool = True  # fixed-order kernels (ops.py); False: the vendor fast path
    rank_devices: tuple[int, ...] = ()  # each rank's index in the device mask; () = its rank
    cuda_graphs: bool = True  # decode steps as CUDA graphs (model/graphs.py) where they can be
    settings: ServeSettings = field(default_factory=ServeSettings)

    @property
    def shares_devices(self) -> bool:
        """Ranks of this server on one device: TP collectives go through host memory."""
        return len(set(self.rank_devices)) < len(self.rank_devices)

    @property
    def title_role(self) -> str:
        return role_name(self.role, self.replica)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdctl.serve", description="pdctl's embedded server")
    p.add_argument(
        "--role", required=True, choices=["colocated", "prefill", "decode", "encoder", "router"]
    )
    p.add_argument("--topology-name", default="adhoc")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dist-port", type=int)
    p.add_argument("--device", default="cpu")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model-preset")
    model.add_argument("--model-path")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--chunked-prefill-tokens", type=int, default=512)
    p.add_argument("--kv-pool-tokens", type=int)
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fixed-order (batch-invariant) kernels; --no-deterministic: the vendor fast path",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode steps as CUDA graphs on CUDA at TP 1",
    )
    p.add_argument("--rank-devices", default="", help="each rank's device index, e.g. 0,0")
    p.add_argument("--transfer-backend", default="tcp", choices=["tcp", "mooncake", "nixl"])
    p.add_argument("--transport-ports", default="")
    p.add_argument("--mooncake-protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--ib-device", action="append", default=[])
    p.add_argument("--nixl-backend", default="UCX")
    staging = p.add_mutually_exclusive_group()
    staging.add_argument("--staging", dest="staging", action="store_true", default=True)
    staging.add_argument("--no-staging", dest="staging", action="store_false")
    p.add_argument("--staging-pool-mb", type=float, default=64.0)
    p.add_argument("--staging-segment-mb", type=float, default=16.0)
    p.add_argument("--bootstrap-port", type=int)
    p.add_argument("--connect-timeout", type=float, default=10.0)
    p.add_argument("--bootstrap-timeout", type=float, default=30.0)
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT")
    )
    p.add_argument("--decode", action="append", default=[])
    p.add_argument("--encoder", action="append", default=[])
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument(
        "--pd-flow",
        choices=["bootstrap", "vllm"],
        default="bootstrap",
        help="router: bootstrap fields to both sides at once (pdctl, SGLang), or vLLM's "
        "kv_transfer_params through prefill then decode",
    )
    p.add_argument("--embedding-pool-mb", type=float, default=16.0)
    add_arguments(p)
    return p


def parse(argv: list[str]) -> ServerArgs:
    p = parser()
    a = p.parse_args(argv)
    if a.role != "router" and a.model_preset is None and a.model_path is None:
        a.model_preset = "tiny"
    prefill = []
    for entry in a.prefill:
        if len(entry) > 2:
            p.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {entry}")
        port = int(entry[1]) if len(entry) == 2 and entry[1].lower() != "none" else None
        prefill.append((entry[0], port))
    # the flags' lists and texts as the fields' tuples; a field is then the flag of its name
    a.prefill, a.decode, a.encoder = tuple(prefill), tuple(a.decode), tuple(a.encoder)
    a.transport_ports = tuple(int(x) for x in a.transport_ports.split(",") if x)
    a.rank_devices = _rank_devices(p, a.rank_devices, a.tp)
    flags = {f.name: getattr(a, f.name) for f in fields(ServerArgs) if hasattr(a, f.name)}
    return ServerArgs(
        **flags,
        overlap=not a.disable_overlap,
        ib_devices=tuple(a.ib_device),
        settings=from_namespace(a),
    )


def _rank_devices(p: argparse.ArgumentParser, text: str, tp: int) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        devices = tuple(int(x) for x in text.split(","))
    except ValueError:
        p.error(f"--rank-devices takes comma-separated device indices, got {text!r}")
    if len(devices) != tp or min(devices) < 0:
        p.error(f"--rank-devices needs {tp} indices >= 0 (one per rank), got {text!r}")
    return devices
