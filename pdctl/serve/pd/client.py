"""HTTP calls between PD processes (bootstrap, internal reports), bounded and authenticated."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx


class PeerCallError(RuntimeError):
    """A call to another PD process failed; the message names it."""


def run_secret() -> bytes:
    return os.environ.get("PDCTL_RUN_SECRET", "").encode()


class Client:
    def __init__(self, base_url: str, name: str, timeout: float) -> None:
        self.base_url, self.name, self.timeout = base_url.rstrip("/"), name, timeout
        self.http = httpx.Client(
            timeout=timeout, headers={"authorization": f"Bearer {run_secret().decode()}"}
        )

    def call(
        self, method: str, path: str, *, retry_until: float | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """One request; with `retry_until`, connection failures are retried until then."""
        while True:
            try:
                response = self.http.request(method, f"{self.base_url}{path}", **kwargs)
            except httpx.TransportError as exc:
                if retry_until is not None and time.monotonic() < retry_until:
                    time.sleep(0.05)
                    continue
                raise PeerCallError(f"{self.name} ({self.base_url}) unreachable: {exc}") from None
            if response.status_code >= 400:
                try:
                    detail = response.json().get("error", response.text)
                except ValueError:
                    detail = response.text
                raise PeerCallError(f"{self.name} refused {path}: {response.status_code} {detail}")
            value: dict[str, Any] = response.json()
            return value

    def close(self) -> None:
        self.http.close()
