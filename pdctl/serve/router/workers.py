"""The router's workers and their health: the prefill, decode and encoder servers it
routes to, picked round-robin among the healthy ones, and the loop that asks each its
/health (a worker is dropped when it refuses the connection, or after MISSED_CHECKS
failed checks in a row). The router is ready only once every side has a healthy worker
(a router that says healthy before any worker is ready is a known trap).

A PD request holds a slot on its prefill and on its decode server while it is
forwarded (prefill's first: one order for every request, so no two wait on each other),
as many slots as the server admits (`max_running_requests`, asked once it is healthy).
More requests than that wait here, not on the servers: a prefill and a decode server
each admitting its own first N of more than N requests admit different requests, each
holding what the other side's requests wait for (decode's pages and ring regions,
prefill's running slots), until the bootstrap timeout fails them (seen in the soak at
concurrency 64 against 32 slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

# A worker whose /health times out or answers an error this many checks in a row is
# dropped (one slow answer on a loaded machine is not a dead server); one that refuses
# the connection is dropped at once: nothing listens there any more.
MISSED_CHECKS = 3


@dataclass
class Worker:
    role: str
    url: str
    bootstrap_port: int | None = None
    healthy: bool = False
    last_error: str = "not checked yet"
    capacity: int | None = None  # requests it admits at once (None: not known yet)
    in_flight: int = 0
    missed: int = 0  # checks failed in a row
    _slots: asyncio.Semaphore | None = field(default=None, repr=False, compare=False)

    def answered(self) -> None:
        """Its /health answered 200."""
        self.healthy, self.missed, self.last_error = True, 0, ""

    def missed_check(self, why: str, refused: bool = False) -> None:
        """Its /health failed (`why`); dropped once refused or after MISSED_CHECKS."""
        self.missed += 1
        self.last_error = why
        if refused or self.missed >= MISSED_CHECKS:
            self.healthy = False

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    def set_capacity(self, capacity: int) -> None:
        if self.capacity is None and capacity > 0:
            self.capacity, self._slots = capacity, asyncio.Semaphore(capacity)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the worker's admission slots (none to take while it is unknown)."""
        slots = self._slots
        if slots is not None:
            await slots.acquire()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if slots is not None:
                slots.release()

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class RouterState:
    prefill: list[Worker]
    decode: list[Worker]
    timeout: float
    encoder: list[Worker] = field(default_factory=list)  # EPD topologies
    flow: str = "bootstrap"  # how a request is split: SGLang's bootstrap fields, or vllm's
    counters: dict[str, int] = field(default_factory=lambda: {"requests": 0, "failed": 0})
    _prefill_turn: itertools.count[int] = field(default_factory=itertools.count)
    _decode_turn: itertools.count[int] = field(default_factory=itertools.count)
    _encoder_turn: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode + self.encoder

    def pick_encoder(self) -> Worker | None:
        encoders = [w for w in self.encoder if w.healthy] or self.encoder
        return encoders[next(self._encoder_turn) % len(encoders)] if encoders else None

    def pick(self) -> tuple[Worker, Worker]:
        prefill = [w for w in self.prefill if w.healthy] or self.prefill
        decode = [w for w in self.decode if w.healthy] or self.decode
        return prefill[next(self._prefill_turn) % len(prefill)], decode[
            next(self._decode_turn) % len(decode)
        ]

    @property
    def ready(self) -> bool:
        return all(
            any(w.healthy for w in workers)
            for workers in (self.prefill, self.decode, self.encoder)
            if workers
        )

    def not_ready_reason(self) -> str:
        """Which side has no healthy worker, and what its workers last answered."""
        missing = []
        sides = (("prefill", self.prefill), ("decode", self.decode), ("encoder", self.encoder))
        for role, workers in sides:
            if workers and not any(w.healthy for w in workers):
                why = ", ".join(f"{w.url}: {w.last_error}" for w in workers)
                missing.append(f"no healthy {role} worker ({why})")
        return "; ".join(missing)


async def check_health(state: RouterState, interval: float = 0.5) -> None:
    """Ask every worker its /health, forever (the router's lifespan cancels it)."""
    async with httpx.AsyncClient(timeout=2.0) as probe:
        while True:
            await check_once(state, probe)
            await asyncio.sleep(interval)


async def check_once(state: RouterState, probe: httpx.AsyncClient) -> None:
    """Every worker's /health, once, all at the same time (a slow one delays no other)."""
    await asyncio.gather(*(_check(worker, probe) for worker in state.workers))


async def _check(worker: Worker, probe: httpx.AsyncClient) -> None:
    try:
        response = await probe.get(f"{worker.url}/health")
    except httpx.ConnectError as exc:
        worker.missed_check(_why(exc), refused=True)
        return
    except httpx.HTTPError as exc:
        worker.missed_check(_why(exc))
        return
    if response.status_code != 200:
        worker.missed_check(f"/health answered {response.status_code}")
        return
    worker.answered()
    if worker.capacity is None:
        await _learn_capacity(probe, worker)


def _why(exc: httpx.HTTPError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _learn_capacity(probe: httpx.AsyncClient, worker: Worker) -> None:
    """The worker's max_running_requests from its /get_server_info (pdctl's servers and
    SGLang's report it); a server that does not is forwarded to without a limit."""
    try:
        response = await probe.get(f"{worker.url}/get_server_info")
    except httpx.HTTPError:
        return  # asked again at the next check
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        worker.set_capacity(int(response.json()["max_running_requests"]))
    if worker.capacity is None:
        worker.capacity = 0  # asked once: it reports none
