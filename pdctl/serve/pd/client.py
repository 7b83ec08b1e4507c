"""HTTP calls between PD processes (the bootstrap endpoint), bounded and authenticated."""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import Any

import httpx
from fastapi.responses import JSONResponse

from pdctl.serve.settings import Handoff
from pdctl.settings import RUN_SECRET_VAR

log = logging.getLogger("pdctl.serve")


class PeerCallError(RuntimeError):
    """A call to another PD process failed; the message names it (status: the HTTP one;
    refused: nothing listens there, the connection was refused)."""

    def __init__(self, message: str, status: int | None = None, refused: bool = False) -> None:
        super().__init__(message)
        self.status, self.refused = status, refused


def run_secret() -> bytes:
    """The per-run secret the launcher handed this process (empty outside a run)."""
    return Handoff.from_environ(os.environ).secret


def refuse_unless_authorized(request: Any, secret: bytes, endpoint: str) -> Any:
    """None when `request` carries the per-run secret; else a 401 (logged, secret never)."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ").encode()
    if hmac.compare_digest(given, secret):
        return None
    client = request.client.host if request.client else "?"
    log.warning(
        "%s: refused %s %s from %s: %s per-run secret",
        endpoint,
        request.method,
        request.url.path,
        client,
        "wrong" if given else "no",
    )
    return JSONResponse({"error": "missing or wrong per-run secret"}, status_code=401)


def warn_if_no_secret(role: str, host: str) -> None:
    if not run_secret():
        log.warning(
            "%s: %s is not set, so the bootstrap endpoints accept any client "
            "that can reach %s (pdctl up always sets it)",
            role,
            RUN_SECRET_VAR,
            host,
        )


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
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:  # never reachable
                message = f"{self.name} ({self.base_url!r}) is no address: {exc}"
                raise PeerCallError(message) from None
            except httpx.TransportError as exc:
                if retry_until is not None and time.monotonic() < retry_until:
                    time.sleep(0.05)
                    continue
                refused = isinstance(exc, httpx.ConnectError) and "refused" in str(exc).lower()
                raise PeerCallError(
                    f"{self.name} ({self.base_url}) unreachable: {exc}", refused=refused
                ) from None
            if response.status_code >= 400:
                try:
                    detail = response.json().get("error", response.text)
                except ValueError:
                    detail = response.text
                raise PeerCallError(
                    f"{self.name} refused {path}: {response.status_code} {detail}",
                    response.status_code,
                )
            value: dict[str, Any] = response.json()
            return value

    def close(self) -> None:
        self.http.close()
