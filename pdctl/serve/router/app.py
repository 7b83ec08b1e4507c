"""The router's FastAPI application: /generate, /v1/completions and
/v1/chat/completions forwarded to prefill and decode (forward.py), /v1/models from a
decode server, and the router's own /health, /get_server_info and /metrics.

A batch of prompts is split into one PD request per prompt and the answers joined; a
chat is one request. Bodies are bounded and must be JSON objects; a request before
the router is ready is a 503 that names the side without a healthy worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Path
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers

from pdctl.records import JSONValue
from pdctl.serve.api.errors import error_body
from pdctl.serve.api.guards import MAX_BODY_BYTES, guard_json_depth, refuse_oversized
from pdctl.serve.api.openai_schemas import ChatBody, CompletionBody
from pdctl.serve.api.openapi import Document, Route, describe
from pdctl.serve.api.schemas import GenerateBody
from pdctl.serve.faults import faults
from pdctl.serve.router import vllm_flow
from pdctl.serve.router.forward import (
    SideFailed,
    forward_get,
    merge_completions,
    route_one,
    route_stream,
    split_batch,
)
from pdctl.serve.router.workers import RouterState, check_health

CLIENT_KEEP_ALIVE_S = 10  # under the servers' 30 s (serve/http.py KEEP_ALIVE_S)

FORWARDED = ("/generate", "/v1/completions", "/v1/chat/completions")
PRINTABLE = Path(
    description="A model id; one a URL cannot carry is refused.", pattern=r"^[^\x00-\x1f\x7f]+$"
)
SIDES = (400, 404, 502, 503, 504)  # a request through the router: its own and the sides'
# the bodies are forwarded as they came (size and depth guarded), documented, not parsed
ROUTES: dict[tuple[str, str], Route] = {
    ("POST", "/generate"): Route(SIDES, streams=True, body=GenerateBody),
    ("POST", "/v1/completions"): Route(SIDES, streams=True, body=CompletionBody),
    ("POST", "/v1/chat/completions"): Route(SIDES, streams=True, body=ChatBody),
    ("GET", "/v1/models"): Route((502, 503)),
    ("GET", "/v1/models/{model_id}"): Route((400, 404, 502, 503)),
    ("GET", "/health"): Route((503,)),
    ("GET", "/metrics"): Route(text=True),
}
VLLM_FORWARDED = ("/v1/completions", "/v1/chat/completions")  # vLLM has no /generate
EVENTS = "text/event-stream"


def error(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status=status), status_code=status)


async def read_body(request: HttpRequest) -> dict[str, JSONValue] | JSONResponse:
    refused = refuse_oversized(request, MAX_BODY_BYTES)
    if refused is not None:
        return JSONResponse(error_body(refused[1]), status_code=refused[0])
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError, RecursionError):
        return error("the body is not valid JSON", 400)
    if not isinstance(body, dict):
        return error("the body must be a JSON object", 400)
    return body  # JSON as decoded: the router reads a few fields and forwards the rest


def batch_key(path: str, body: Mapping[str, JSONValue]) -> str | None:
    """The key whose list is a batch of prompts on `path` (a chat is one prompt)."""
    if path == "/v1/completions":
        return "prompt"
    if path == "/generate":
        return "input_ids" if "input_ids" in body else "text"
    return None


async def forward(
    state: RouterState,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, JSONValue],
    headers: Headers,
) -> Response:
    key = batch_key(path, body)
    parts = split_batch(body, key) if key else None

    def one(part: dict[str, JSONValue]) -> Awaitable[Any]:
        if state.flow == "vllm":
            return vllm_flow.route_one(state, client, path, part, headers)
        return route_one(state, client, path, part)

    try:
        if parts is None:
            result = await asyncio.wait_for(one(body), state.timeout)
        else:
            routed = (one(part) for part in parts)
            result = await asyncio.wait_for(asyncio.gather(*routed), state.timeout)
            if path == "/v1/completions":
                result = merge_completions(result)
    except SideFailed as exc:
        state.counters["failed"] += 1
        return error(str(exc), exc.status)
    except TimeoutError:
        state.counters["failed"] += 1
        return error(f"no answer within {state.timeout:g} s", 504)
    return JSONResponse(result)


async def stream(
    state: RouterState,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, JSONValue],
    headers: Headers,
) -> Response:
    """A streamed answer: decode's events. In vLLM's flow prefill runs first, so its
    failure is still an HTTP error naming it, before any event."""
    if state.flow != "vllm":
        return StreamingResponse(route_stream(state, client, path, body), media_type=EVENTS)
    rid = vllm_flow.request_id(headers)
    try:
        decode, routed = await asyncio.wait_for(
            vllm_flow.prefilled(state, client, path, body, rid), state.timeout
        )
    except SideFailed as exc:
        state.counters["failed"] += 1
        return error(str(exc), exc.status)
    except TimeoutError:
        state.counters["failed"] += 1
        return error(f"prefill gave no answer within {state.timeout:g} s", 504)
    events = vllm_flow.stream_from_decode(client, decode, path, routed, rid)
    return StreamingResponse(events, media_type=EVENTS)


def add_forwarded(app: FastAPI, state: RouterState, client: httpx.AsyncClient) -> None:
    async def handle(request: HttpRequest) -> Response:
        path = request.url.path
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        if not state.ready:
            return error(state.not_ready_reason(), 503)
        if state.flow == "vllm" and path not in VLLM_FORWARDED:
            return error(f"vLLM's servers take {' and '.join(VLLM_FORWARDED)}, not {path}", 404)
        faults().request_arrived()  # fault injection (kill-role); off unless asked for
        state.counters["requests"] += 1
        if body.get("stream"):
            return await stream(state, client, path, body, request.headers)
        return await forward(state, client, path, body, request.headers)

    for path in FORWARDED:
        app.add_api_route(path, handle, methods=["POST"])

    async def models(request: HttpRequest) -> Response:
        return await forward_models(state, client, "/v1/models")

    async def model(model_id: str = PRINTABLE) -> Response:
        """One model: its id goes on percent-encoded; one a URL cannot carry (control
        characters, or nothing) is a 400 here, never forwarded."""
        if not model_id or not model_id.isprintable():
            return error("the model id holds characters a URL cannot carry", 400)
        return await forward_models(state, client, f"/v1/models/{quote(model_id, safe='')}")

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])


async def forward_models(state: RouterState, client: httpx.AsyncClient, path: str) -> Response:
    if not state.ready:
        return error(state.not_ready_reason(), 503)
    try:
        answer = await forward_get(state, client, path)
    except SideFailed as exc:
        return error(str(exc), exc.status)
    if answer.status_code >= 500:  # a decode server's failure, named as the router names it
        return error(f"decode failed: {answer.status_code} {answer.text[:300]}", 502)
    return Response(answer.content, answer.status_code, media_type="application/json")


def add_own(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return JSONResponse({"status": "ok"})
        return error(state.not_ready_reason(), 503)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, object]:  # serialized only
        return {
            "role": "router",
            "prefill": [w.to_json() for w in state.prefill],
            "decode": [w.to_json() for w in state.decode],
            "encoder": [w.to_json() for w in state.encoder],
            "ready": state.ready,
            "stats": dict(state.counters),
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        lines = [f"pdctl_router_{k}_total {v}" for k, v in state.counters.items()]
        lines += [
            f'pdctl_router_worker_healthy{{role="{w.role}",url="{w.url}"}} {int(w.healthy)}'
            for w in state.workers
        ]
        return PlainTextResponse("\n".join(lines) + "\n")


def create_router_app(state: RouterState) -> FastAPI:
    client = httpx.AsyncClient(  # idle connections closed before the servers close them
        timeout=state.timeout, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE_S)
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(check_health(state))
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="pdctl router", docs_url=None, redoc_url=None, lifespan=lifespan)
    guard_json_depth(app)
    add_forwarded(app, state, client)
    add_own(app, state)
    describe(app, Document("pdctl router", ROUTES, answers_within_s=state.timeout))
    return app
