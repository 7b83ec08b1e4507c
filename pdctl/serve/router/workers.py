"""The router's workers and their health: the prefill, decode and encoder servers it
routes to, picked round-robin among the healthy ones, and the loop that asks each its
/health. The router is ready only once every side has a healthy worker (a router that
says healthy before any worker is ready is a known trap).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx


@dataclass
class Worker:
    role: str
    url: str
    bootstrap_port: int | None = None
    healthy: bool = False
    last_error: str = "not checked yet"

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"


@dataclass
class RouterState:
    prefill: list[Worker]
    decode: list[Worker]
    timeout: float
    encoder: list[Worker] = field(default_factory=list)  # EPD topologies
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
            any(w.healthy for w in workers) for workers in (self.prefill, self.decode, self.encoder)
            if workers
        )  # fmt: skip

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
            for worker in state.workers:
                try:
                    response = await probe.get(f"{worker.url}/health")
                    worker.healthy = response.status_code == 200
                    worker.last_error = (
                        "" if worker.healthy else f"/health answered {response.status_code}"
                    )
                except httpx.HTTPError as exc:
                    worker.healthy = False
                    worker.last_error = (
                        f"{type(exc).__name__}: {exc}" if str(exc) else (type(exc).__name__)
                    )
            await asyncio.sleep(interval)
