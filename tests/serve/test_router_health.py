"""The builtin router's health loop: one slow or failed /health does not drop a worker
(a loaded machine answers late), MISSED_CHECKS in a row do, a refused connection does at
once; a worker that answers again is picked again. Real HTTP on loopback: a small
server whose /health is scripted, and the router's own checks against it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from pdctl.serve.router.workers import MISSED_CHECKS, RouterState, Worker, check_once
from tests.serve.conftest import app_in_thread, free_port

PROBE_TIMEOUT_S = 0.2


class Scripted:
    """/health answers `status`, after `delay` seconds."""

    def __init__(self) -> None:
        self.status, self.delay = 200, 0.0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            await asyncio.sleep(self.delay)
            return Response(status_code=self.status)

        @app.get("/get_server_info")
        async def info() -> dict[str, int]:
            return {"max_running_requests": 4}

        return app


@pytest.fixture
def scripted() -> Iterator[tuple[Scripted, str]]:
    health = Scripted()
    with app_in_thread(health.app()) as url:
        yield health, url


def checks(state: RouterState, rounds: int = 1) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as probe:
            for _ in range(rounds):
                await check_once(state, probe)

    asyncio.run(run())


def test_slow_answers_drop_a_worker_only_after_missed_checks_in_a_row(
    scripted: tuple[Scripted, str],
) -> None:
    health, url = scripted
    worker = Worker("prefill", url)
    state = RouterState(prefill=[worker], decode=[Worker("decode", url)], timeout=5.0)
    checks(state)
    assert worker.healthy and worker.capacity == 4 and worker.last_error == ""
    health.delay = PROBE_TIMEOUT_S * 3  # past the probe's timeout
    checks(state, MISSED_CHECKS - 1)
    assert worker.healthy and worker.missed == MISSED_CHECKS - 1
    assert worker.last_error.startswith("ReadTimeout")
    checks(state)
    assert not worker.healthy and worker.missed == MISSED_CHECKS
    assert "no healthy prefill worker" in state.not_ready_reason()
    health.delay = 0.0
    checks(state)
    assert worker.healthy and worker.missed == 0 and state.pick()[0] is worker


def test_error_answers_count_as_missed_checks(scripted: tuple[Scripted, str]) -> None:
    health, url = scripted
    worker = Worker("decode", url)
    state = RouterState(prefill=[], decode=[worker], timeout=5.0)
    checks(state)
    health.status = 503
    checks(state)
    assert worker.healthy and worker.last_error == "/health answered 503"
    checks(state, MISSED_CHECKS - 1)
    assert not worker.healthy


def test_a_refused_connection_drops_the_worker_at_once(scripted: tuple[Scripted, str]) -> None:
    _, url = scripted
    alive, gone = Worker("prefill", url), Worker("prefill", f"http://127.0.0.1:{free_port()}")
    state = RouterState(prefill=[alive, gone], decode=[Worker("decode", url)], timeout=5.0)
    gone.healthy = True  # it was serving, then its process ended
    checks(state)
    assert alive.healthy and not gone.healthy and gone.missed == 1
    assert gone.last_error.startswith("ConnectError")
    assert {state.pick()[0].url for _ in range(4)} == {url}  # only the live one is picked


def test_one_slow_worker_does_not_delay_the_others(scripted: tuple[Scripted, str]) -> None:
    health, url = scripted
    health.delay = PROBE_TIMEOUT_S * 3
    workers = [Worker("prefill", url) for _ in range(4)]
    state = RouterState(prefill=workers, decode=[], timeout=5.0)
    started = time.perf_counter()
    checks(state)
    elapsed = time.perf_counter() - started
    assert elapsed < PROBE_TIMEOUT_S * 3, elapsed  # one probe's timeout, not four
    assert all(w.missed == 1 for w in workers)
