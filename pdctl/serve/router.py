"""The builtin PD router: one request goes to a prefill and a decode server at once.

It adds `bootstrap_host`, `bootstrap_port` and a random 63-bit `bootstrap_room`,
sends both requests concurrently, and answers with decode's response (streams pass
through). Prefill and decode replicas are used round-robin. `/health` is 200 only
once at least one prefill and one decode answer their own /health (a router that
says healthy before any worker is ready is a known trap). When a side fails, the
client's error names that side; the other side's request is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pdctl.serve.args import ServerArgs
from pdctl.serve.faults import faults
from pdctl.serve.guards import MAX_BODY_BYTES, guard_json_depth, refuse_oversized
from pdctl.serve.schemas import error_body

log = logging.getLogger("pdctl.serve")


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


class SideFailed(Exception):
    """A worker failed a request (side None: the router itself refused it)."""

    def __init__(self, side: Worker | None, message: str, status: int = 502) -> None:
        text = f"{side.role} {side.url} failed: {message}" if side else f"router: {message}"
        super().__init__(text)
        self.side, self.message, self.status = side, message, status

    def paired_with(self, other: Worker) -> SideFailed:
        """The same failure, naming the other side of the request too (which decode a
        prefill waited for is often the real culprit)."""
        return SideFailed(
            self.side, f"{self.message} (the request's {other.role}: {other.url})", self.status
        )


async def _post(
    client: httpx.AsyncClient, worker: Worker, path: str, body: dict[str, Any]
) -> httpx.Response:
    try:
        response = await client.post(f"{worker.url}{path}", json=body)
    except httpx.HTTPError as exc:
        raise SideFailed(worker, f"{type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        try:
            detail = response.json().get("error", {}).get("message", response.text)
        except (ValueError, AttributeError):
            detail = response.text
        status = response.status_code if response.status_code < 500 else 502
        raise SideFailed(worker, f"{response.status_code} {detail}", status)
    return response


def _with_bootstrap(body: dict[str, Any], prefill: Worker) -> dict[str, Any]:
    return {
        **body,
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": secrets.randbits(63),
    }


def _split(body: dict[str, Any], key: str) -> list[dict[str, Any]] | None:
    """A batch body as one body per prompt, or None when it is one prompt."""
    value = body.get(key)
    if key == "input_ids" and isinstance(value, list) and value and isinstance(value[0], list):
        return [{**body, key: item} for item in value]
    if (
        key in ("text", "prompt")
        and isinstance(value, list)
        and value
        and all(isinstance(v, (str, list)) for v in value)
    ):
        if key == "prompt" and all(isinstance(v, int) for v in value):
            return None
        return [{**body, key: item} for item in value]
    return None


async def _encode(
    state: RouterState, client: httpx.AsyncClient, path: str, body: dict[str, Any], prefill: Worker
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """EPD: a request with images goes to an encoder first, which writes the embeddings
    into `prefill`'s pool. Returns the body that goes on (the expanded prompt instead of
    the images) and what the encoder moved, for the answer's meta_info."""
    if body.get("image") is None and body.get("images") is None:
        return body, None
    if path != "/generate":
        raise SideFailed(None, "images are taken on /generate only", 400)
    encoder = state.pick_encoder()
    if encoder is None:
        raise SideFailed(None, "this topology has no encoder for images", 400)
    room = secrets.randbits(63)
    request = {
        **body,
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.bootstrap_port,
        "embedding_room": room,
    }
    encoded = (await _post(client, encoder, "/encode", request)).json()
    rest = {k: v for k, v in body.items() if k not in ("image", "images", "text", "input_ids")}
    routed = {
        **rest,
        "input_ids": encoded["input_ids"],
        "mm_items": encoded["mm_items"],
        "embedding_room": room,
    }
    return routed, encoded.get("embedding_transfer")


def _add_prefill_side(meta: dict[str, Any], prefill_answer: Any) -> None:
    """Decode's kv_transfer times the receive; prefill's times the send. Both go in
    the answer: `write_ms` (prefill gathering, digesting and writing, the part the
    staging kernels and the transport own) and `send_ms` (prefill's whole send,
    waits for decode's ring regions included), with `gather_ms` and `digest_ms`, the
    parts of write_ms spent gathering and taking digests."""
    transfer = meta.get("kv_transfer")
    sent = None
    if isinstance(prefill_answer, dict) and isinstance(prefill_answer.get("meta_info"), dict):
        sent = prefill_answer["meta_info"].get("kv_transfer")
    if not isinstance(transfer, dict) or not isinstance(sent, dict):
        return
    pairs = ("write_ms", "write_ms"), ("gather_ms", "gather_ms"), ("digest_ms", "digest_ms")
    for theirs, ours in (*pairs, ("transfer_ms", "send_ms")):
        if isinstance(sent.get(theirs), (int, float)):
            transfer[ours] = sent[theirs]


async def route_one(
    state: RouterState, client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> Any:
    prefill, decode = state.pick()
    body, embedding = await _encode(state, client, path, body, prefill)
    routed = _with_bootstrap({**body, "stream": False}, prefill)
    prefill_task = asyncio.create_task(_post(client, prefill, path, routed))
    decode_task = asyncio.create_task(_post(client, decode, path, routed))
    try:
        done, _ = await asyncio.wait(
            {prefill_task, decode_task}, return_when=asyncio.FIRST_EXCEPTION
        )
        for task in done:
            error = task.exception()
            if isinstance(error, SideFailed):
                raise error.paired_with(decode if error.side is prefill else prefill)
            if error is not None:
                raise error
        answer = (await decode_task).json()
        prefilled = await prefill_task
        meta = answer.get("meta_info")
        if isinstance(meta, dict):
            with contextlib.suppress(ValueError):  # decode's answer stands without it
                _add_prefill_side(meta, prefilled.json())
            if embedding is not None:
                meta["embedding_transfer"] = embedding
        return answer
    finally:
        for task in (prefill_task, decode_task):
            task.cancel()


async def route_stream(
    state: RouterState, client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[bytes]:
    prefill, decode = state.pick()
    try:
        body, _ = await _encode(state, client, path, body, prefill)
    except SideFailed as exc:
        yield f"data: {json.dumps(error_body(str(exc), status=exc.status))}\n\n".encode()
        yield b"data: [DONE]\n\n"
        return
    routed = _with_bootstrap(body, prefill)
    prefill_task = asyncio.create_task(_post(client, prefill, path, {**routed, "stream": False}))
    try:
        async with client.stream("POST", f"{decode.url}{path}", json=routed) as response:
            if response.status_code >= 400:
                text = (await response.aread()).decode(errors="replace")
                raise SideFailed(decode, f"{response.status_code} {text}")
            async for chunk in response.aiter_raw():
                if prefill_task.done() and prefill_task.exception() is not None:
                    raise prefill_task.exception()  # type: ignore[misc]
                yield chunk
        await prefill_task
    except SideFailed as exc:
        yield f"data: {json.dumps(error_body(str(exc), status=exc.status))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    except httpx.HTTPError as exc:
        body = error_body(f"decode {decode.url} failed: {exc}", status=502)
        yield f"data: {json.dumps(body)}\n\n".encode()
    finally:
        prefill_task.cancel()


def create_router_app(state: RouterState) -> FastAPI:
    client = httpx.AsyncClient(timeout=state.timeout)

    async def check_health() -> None:
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
                await asyncio.sleep(0.5)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(check_health())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="pdctl router", docs_url=None, redoc_url=None, lifespan=lifespan)
    guard_json_depth(app)

    async def handle(request: HttpRequest, path: str) -> Response:
        refused = refuse_oversized(request, MAX_BODY_BYTES)
        if refused is not None:
            return JSONResponse(error_body(refused[1]), status_code=refused[0])
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError, RecursionError):
            return JSONResponse(error_body("the body is not valid JSON"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the body must be a JSON object"), status_code=400)
        batch_key = (
            "prompt"
            if path == "/v1/completions"
            else "input_ids"
            if "input_ids" in body
            else "text"
        )
        if not state.ready:
            return JSONResponse(error_body(state.not_ready_reason(), status=503), status_code=503)
        faults().request_arrived()  # fault injection (kill-role); off unless asked for
        state.counters["requests"] += 1
        if body.get("stream"):
            return StreamingResponse(
                route_stream(state, client, path, body), media_type="text/event-stream"
            )
        parts = _split(body, batch_key)
        try:
            if parts is None:
                result = await asyncio.wait_for(route_one(state, client, path, body), state.timeout)
            else:
                result = await asyncio.wait_for(
                    asyncio.gather(*(route_one(state, client, path, part) for part in parts)),
                    state.timeout,
                )
                if path == "/v1/completions":
                    result = _merge_completions(result)
        except SideFailed as exc:
            state.counters["failed"] += 1
            return JSONResponse(error_body(str(exc), status=exc.status), status_code=exc.status)
        except TimeoutError:
            state.counters["failed"] += 1
            return JSONResponse(
                error_body(f"no answer within {state.timeout:g} s", status=504), status_code=504
            )
        return JSONResponse(result)

    @app.post("/generate")
    async def generate(request: HttpRequest) -> Response:
        return await handle(request, "/generate")

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        return await handle(request, "/v1/completions")

    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            error_body(state.not_ready_reason(), status=503),
            status_code=503,
        )

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "role": "router",
            "prefill": [vars(w) for w in state.prefill],
            "decode": [vars(w) for w in state.decode],
            "encoder": [vars(w) for w in state.encoder],
            "ready": state.ready,
            "stats": dict(state.counters),
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [f"pdctl_router_{k}_total {v}" for k, v in state.counters.items()]
        lines += [
            f'pdctl_router_worker_healthy{{role="{w.role}",url="{w.url}"}} {int(w.healthy)}'
            for w in state.workers
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    return app


def _merge_completions(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(parts[0])
    merged["choices"] = [{**part["choices"][0], "index": i} for i, part in enumerate(parts)]
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for part in parts:
        for key in usage:
            usage[key] += int(part.get("usage", {}).get(key, 0))
    merged["usage"] = usage
    return merged


def run(args: ServerArgs) -> None:
    from pdctl.serve.roles.common import run_servers
    from pdctl.serve.runtime import set_identity

    set_identity(args)
    if not args.prefill or not args.decode:
        raise SystemExit(
            "the router needs at least one --prefill URL BOOTSTRAP_PORT and one --decode URL"
        )
    state = RouterState(
        prefill=[Worker("prefill", url.rstrip("/"), port) for url, port in args.prefill],
        decode=[Worker("decode", url.rstrip("/")) for url in args.decode],
        timeout=args.request_timeout,
        encoder=[Worker("encoder", url.rstrip("/")) for url in args.encoder],
    )
    log.info(
        "routing %d prefill and %d decode workers (%s)",
        len(state.prefill),
        len(state.decode),
        time.strftime("%H:%M:%S"),
    )
    run_servers([(create_router_app(state), args.host, args.port)])
