"""The OpenAPI document of pdctl's HTTP servers, as the routes behave.

FastAPI documents what a handler declares; what pdctl's guards and handlers answer
besides is added here, from one table per application, when the document is first
asked for: every status a route answers (the guards' 400, 411 and 413 on any body,
FastAPI's 422 replaced by the 400 the validation handler answers, a missing model's
404, a role that is not ready's 503, a peer's 502 and 504 behind the router), each
with the error body all of them answer (OpenAI's shape); the content types (Prometheus
text, event streams); the request bodies of routes that read their body themselves
(the router forwards bodies without parsing them, so its schemas are documented, not
applied); and the bound within which a route answers (`x-pdctl-answers-within-s`).
The guards stay as they are: the document describes them, it does not replace them.
Torch-free: the router imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from pdctl.serve.api.guards import MAX_BODY_BYTES


class JsonObject(BaseModel):
    """A JSON object the route reads and checks itself (pdctl's internal messages)."""

    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str = Field(description="What is wrong, naming the field where one is.")
    type: str = Field(description="BadRequestError, NotFoundError or ServiceUnavailableError.")
    param: str | None = Field(None, description="The request field at fault, if one is.")
    code: int = Field(description="The HTTP status, again.")


class ErrorBody(BaseModel):
    """Every error answer of pdctl's servers and router (OpenAI's error shape)."""

    error: ErrorDetail


STATUSES: dict[int, str] = {
    401: "The per-run secret is missing or wrong (pdctl's internal endpoints).",
    400: "The request is malformed (not JSON, not an object, nested too deeply, a field "
    "out of range or unknown, ids outside the vocabulary, longer than the context) or "
    "this server cannot serve it (a prefill or decode server serves PD requests only).",
    404: "No such model (or route) here.",
    409: "A PD request's bootstrap_room (or a decode rank's registration of it, an embedding "
    "room) is already taken.",
    410: "The room is closed (failed, aborted or done) or its embedding expired.",
    411: "A body sent chunked, without a Content-Length, is refused before it is read.",
    413: f"A body larger than the server's limit ({MAX_BODY_BYTES} bytes; 4 MiB on the bootstrap "
    "endpoint) is refused before it is read.",
    502: "A prefill or decode server behind the router failed the request (the message "
    "names the side and what it answered).",
    503: "Not ready: the engine or a side of the topology has no healthy server (or the "
    "embedding pool is full: retry).",
    504: "No answer within the router's request timeout.",
}
BODY_STATUSES = (400, 411, 413)  # any route with a body: the guards'
INTERNAL_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}


@dataclass(frozen=True)
class Route:
    """What a route answers besides a 200 with the JSON its handler declares."""

    statuses: tuple[int, ...] = ()
    text: bool = False  # its 200 is text/plain (Prometheus exposition)
    streams: bool = False  # its 200 is an event stream when the body says `stream: true`
    body: type[BaseModel] | None = None  # the body a route that reads it itself takes
    internal: bool = False  # pdctl's own endpoints: errors are {"error": ...}


@dataclass(frozen=True)
class Document:
    """The table of an application's routes, keyed by (method, path)."""

    title: str
    routes: Mapping[tuple[str, str], Route]
    answers_within_s: float | None = None  # the bound of every route's answer, if any
    authenticated: bool = False  # every route wants the per-run secret (a 401 without it)


def describe(app: FastAPI, document: Document) -> None:
    """Have `app` serve `document`'s description of its routes at /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=document.title, version="1", routes=app.routes)
            app.openapi_schema = _completed(schema, document)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _completed(schema: dict[str, Any], document: Document) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _add_model(components, ErrorBody)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            route = document.routes.get((method.upper(), path), Route())
            _complete(operation, route, document, components)
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, never answered
        components.pop(name, None)
    return schema


def _complete(
    operation: dict[str, Any], route: Route, document: Document, components: dict[str, Any]
) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    if route.body is not None:
        _add_model(components, route.body)
        reference = {"$ref": f"#/components/schemas/{route.body.__name__}"}
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": reference}},
        }
    statuses = set(route.statuses)
    if "requestBody" in operation:
        statuses |= set(BODY_STATUSES)
    if operation.get("parameters"):
        statuses.add(400)
    if document.authenticated:
        statuses.add(401)
    error = INTERNAL_ERROR if route.internal else {"$ref": "#/components/schemas/ErrorBody"}
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": STATUSES[status],
            "content": {"application/json": {"schema": error}},
        }
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if route.text:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if route.streams:
        ok.setdefault("content", {"application/json": {"schema": {}}})
        ok["content"]["text/event-stream"] = {"schema": {}}  # data: JSON events, then [DONE]
    if document.answers_within_s is not None:
        operation["x-pdctl-answers-within-s"] = document.answers_within_s


def _add_model(components: dict[str, Any], model: type[BaseModel]) -> None:
    """A model and the models it refers to, as components (pydantic's own JSON Schema)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components.setdefault(model.__name__, schema)
