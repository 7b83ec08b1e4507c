"""A real PD topology on loopback for the tests: prefill, decode and a router process."""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from pdctl.records import ServerInfo
from tests.serve.conftest import Server, free_port, spawn_server, start_server, wait_healthy

# Small enough to start fast, big enough that TP4 splits the KV heads.
MODEL = ("--model-preset", "tiny", "--page-size", "16", "--kv-pool-tokens", "4096")


@dataclass
class PDCluster:
    prefill: list[Server]
    decode: list[Server]
    router: Server | None
    bootstrap_ports: list[int]
    servers: list[Server] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def generate(self, **body: object) -> dict:
        return post(self.url, "/generate", body)

    def pools_full(self, timeout: float = 20.0, servers: list[Server] | None = None) -> None:
        """Every KV page back (apart from the radix cache) and every ring region freed."""
        deadline = time.monotonic() + timeout
        while True:
            states = [(s, s.info()) for s in servers or self.prefill + self.decode]
            leaks = [describe_leak(s, info) for s, info in states]
            leaks = [leak for leak in leaks if leak]
            if not leaks:
                return
            if time.monotonic() > deadline:
                raise AssertionError("; ".join(leaks))
            time.sleep(0.2)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def describe_leak(server: Server, info: dict) -> str:
    """What `server` still holds, in the launcher's words (`ServerInfo.leaks`)."""
    record = ServerInfo.from_json(info)
    leaks = record.leaks()
    return f"{record.role} {server.url}: {', '.join(leaks)}" if leaks else ""


def post(url: str, path: str, body: dict, timeout: float = 120) -> dict:
    response = httpx.post(f"{url}{path}", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


@contextmanager
def pd_cluster(
    *,
    backend: str = "tcp",
    prefill_tp: int = 1,
    decode_tp: int = 2,
    staging: bool = True,
    pool_mb: float = 8.0,
    segment_mb: float = 2.0,
    router: str | None = "builtin",
    replicas: tuple[int, int] = (1, 1),
    timeout: float = 15.0,
    prefill_extra: tuple[str, ...] = (),
    decode_extra: tuple[str, ...] = (),
    prefill_env: dict[str, str] | None = None,
    decode_env: dict[str, str] | None = None,
    model: tuple[str, ...] = MODEL,
) -> Iterator[PDCluster]:
    os.environ.setdefault("PDCTL_RUN_SECRET", secrets.token_hex(16))
    common = [
        *model,
        "--transfer-backend",
        backend,
        "--staging-pool-mb",
        str(pool_mb),
        "--staging-segment-mb",
        str(segment_mb),
        "--bootstrap-timeout",
        str(timeout),
        "--transfer-timeout",
        str(timeout),
        "--staging" if staging else "--no-staging",
    ]
    cluster = PDCluster([], [], None, [])
    try:
        for replica in range(replicas[0]):
            port = free_port()
            extra = _transport_ports(backend, prefill_tp)
            server = spawn_server(
                *common, *extra, "--bootstrap-port", str(port), "--replica", str(replica),
                *prefill_extra, tp=prefill_tp, role="prefill", name="pd", env=prefill_env,
            )  # fmt: skip
            cluster.servers.append(server)
            cluster.prefill.append(server)
            cluster.bootstrap_ports.append(port)
        for replica in range(replicas[1]):
            extra = _transport_ports(backend, decode_tp)
            server = spawn_server(
                *common, *extra, "--replica", str(replica), *decode_extra,
                tp=decode_tp, role="decode", name="pd", env=decode_env,
            )  # fmt: skip
            cluster.servers.append(server)
            cluster.decode.append(server)
        for server in cluster.servers:  # started side by side, healthy one by one
            wait_healthy(server)
        if router is not None:
            cluster.router = start_router(router, cluster)
            cluster.servers.append(cluster.router)
        yield cluster
    finally:
        cluster.stop()


def _transport_ports(backend: str, tp: int) -> list[str]:
    if backend != "tcp":
        return []
    return ["--transport-ports", ",".join(str(free_port()) for _ in range(tp))]


def start_router(kind: str, cluster: PDCluster) -> Server:
    targets: list[str] = []
    for server, port in zip(cluster.prefill, cluster.bootstrap_ports, strict=True):
        targets += ["--prefill", server.url, str(port)]
    for server in cluster.decode:
        targets += ["--decode", server.url]
    if kind == "builtin":
        return start_server(*targets, "--request-timeout", "60", role="router", name="pd")
    return start_sglang_router(targets)


def start_sglang_router(targets: list[str]) -> Server:
    import subprocess
    import tempfile

    port = free_port()
    argv = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        *targets, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by Server.stop)
    process = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"sglang-router exited with {process.returncode}: {tail}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    tail = server.log_tail()
    server.stop()
    raise TimeoutError(f"sglang-router did not become healthy: {tail}")
