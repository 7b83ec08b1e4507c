"""Real server processes on loopback for the serve tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest


def free_port() -> int:
    """A port no other test worker or outgoing connection takes before the server binds it."""
    from pdctl.engines.base import PortSlot
    from pdctl.launch.ports import allocate

    return allocate([PortSlot("test", "port", "test server")], "127.0.0.1").ports["test.port"]


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: object

    def log_tail(self, size: int = 3000) -> str:
        self.log.seek(0)  # type: ignore[attr-defined]
        return self.log.read().decode(errors="replace")[-size:]  # type: ignore[attr-defined]

    def info(self) -> dict:
        return httpx.get(f"{self.url}/get_server_info", timeout=30).json()

    def generate(self, **body: object) -> dict:
        response = httpx.post(f"{self.url}/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()  # type: ignore[attr-defined]


def start_server(
    *extra: str,
    tp: int = 1,
    role: str = "colocated",
    name: str = "test",
    env: dict[str, str] | None = None,
) -> Server:
    """A server process, healthy."""
    server = spawn_server(*extra, tp=tp, role=role, name=name, env=env)
    wait_healthy(server)
    return server


def spawn_server(
    *extra: str,
    tp: int = 1,
    role: str = "colocated",
    name: str = "test",
    env: dict[str, str] | None = None,
) -> Server:
    """A server process, started (`wait_healthy` waits for it): servers that start
    side by side share the host's cores while each waits for its own start-up."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdctl.serve",
        "--role",
        role,
        "--port",
        str(port),
        "--tp",
        str(tp),
        "--topology-name",
        name,
    ]
    if tp > 1:
        argv += ["--dist-port", str(free_port())]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by Server.stop)
    process = subprocess.Popen(
        [*argv, *extra],
        stdout=log,
        stderr=log,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    return Server(f"http://127.0.0.1:{port}", process, log)


def wait_healthy(server: Server, timeout: float = 120.0) -> None:
    """Until the server answers /health (stopped and raised if it exits or times out)."""
    process = server.process
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"server exited with {process.returncode}: {tail}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise TimeoutError(f"server did not become healthy: {server.log_tail()}")


@pytest.fixture
def server_factory() -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def make(*extra: str, **options: object) -> Server:
        server = start_server(*extra, **options)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tp1_server() -> Iterator[Server]:
    server = start_server("--kv-pool-tokens", "8192", "--chunked-prefill-tokens", "64", name="tp1")
    yield server
    server.stop()
