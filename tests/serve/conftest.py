"""Real server processes on loopback for the serve tests.

They start as pdctl's launcher starts a CPU run's servers: forked from a forkserver
that imported the server's modules once (one per test worker, `pdctl.launch.forking`),
or spawned where forking would differ (another environment read at import)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.launch.forking import Starter, forks_by_default
from pdctl.launch.processes import ChildProcess
from pdctl.launch.settings import LaunchSettings


@functools.cache
def starter() -> Starter:
    """This worker's starter, made at its first server (on the main thread, which the
    forkserver's parent-death signal follows) and closed when the worker exits."""
    directory = Path(tempfile.mkdtemp(prefix="pdctl-test-servers-"))
    made = Starter("tests", directory, forks=forks_by_default("cpu", LaunchSettings.from_environ()))

    def close() -> None:
        made.close()
        shutil.rmtree(directory, ignore_errors=True)

    atexit.register(close)
    return made


def in_spawned_ranks(target: Callable[..., None], world: int, *args: object) -> dict[int, str]:
    """`target(rank, *args, results)` in `world` spawned processes (a real TP group's
    ranks); what each put in `results`, by rank. Every process is ended after."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    results: mp.Queue = context.Queue()
    workers = [context.Process(target=target, args=(r, *args, results)) for r in range(world)]
    try:
        for worker in workers:
            worker.start()
        return dict(results.get(timeout=120) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()


def free_port() -> int:
    """A port no other test worker or outgoing connection takes before the server binds it."""
    from pdctl.engines.base import PortSlot
    from pdctl.launch.ports import allocate

    return allocate([PortSlot("test", "port", "test server")], "127.0.0.1").ports["test.port"]


@contextlib.contextmanager
def app_in_thread(app: Any) -> Iterator[str]:
    """`app` (ASGI) served by uvicorn on a loopback port in a thread of this process,
    started before its URL is yielded and told to exit after."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True


@dataclass
class Server:
    url: str
    process: ChildProcess
    log: object  # the log, open for reading
    log_path: Path | None = None  # removed when the server stops

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
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


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
    handle, name = tempfile.mkstemp(prefix=f"pdctl-test-{role}-", suffix=".log")
    log = os.fdopen(handle, "rb")  # closed by Server.stop
    path = Path(name)
    environment = {**os.environ, **(env or {})}
    environment.pop("PYTEST_CURRENT_TEST", None)  # pytest's, a new value each phase
    spawned = starter().spawn(role, [*argv, *extra], environment, path)
    return Server(f"http://127.0.0.1:{port}", spawned.process, log, path)


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
