"""create_app: the FastAPI application of an embedded server, its parts mounted.

Bad requests get a 4xx JSON error naming the field (a validation error's first
location and message); oversized or too deeply nested bodies are refused before
they reach a handler. A role adds its own routes through `setup`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from pdctl.serve.api.admin import add_admin
from pdctl.serve.api.chat import add_chat
from pdctl.serve.api.completions import add_completions
from pdctl.serve.api.errors import BadRequest, error_body
from pdctl.serve.api.generate import add_generate
from pdctl.serve.api.guards import MAX_BODY_BYTES, guard_json_depth, refuse_oversized
from pdctl.serve.api.models import add_models
from pdctl.serve.api.openapi import Document, Route, describe
from pdctl.serve.api.submission import ServerContext


def add_error_handlers(app: FastAPI) -> None:
    guard_json_depth(app)

    @app.exception_handler(BadRequest)
    async def _bad(_: HttpRequest, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.param, exc.status), status_code=exc.status)

    @app.middleware("http")
    async def _limit(request: HttpRequest, call_next: Callable[[HttpRequest], Any]) -> Response:
        refused = refuse_oversized(request, MAX_BODY_BYTES)
        if refused is not None:
            return JSONResponse(error_body(refused[1]), status_code=refused[0])
        response: Response = await call_next(request)
        return response


PD_STATUSES = (409, 503, 504)
ROUTES: dict[tuple[str, str], Route] = {
    ("GET", "/health"): Route((503,)),
    # a prefill or decode server serves PD requests only: it cannot generate alone
    ("GET", "/health_generate"): Route((400, 503)),
    ("GET", "/metrics"): Route(text=True),
    # 409: a PD request's room taken; 504: no KV within the transfer timeouts
    ("POST", "/generate"): Route(PD_STATUSES, streams=True),
    ("POST", "/v1/completions"): Route(PD_STATUSES, streams=True),
    ("POST", "/v1/chat/completions"): Route(PD_STATUSES, streams=True),
    ("GET", "/v1/models/{model_id}"): Route((404,)),
}


def create_app(
    ctx: ServerContext, setup: Callable[[FastAPI, ServerContext], None] | None = None
) -> FastAPI:
    app = FastAPI(title="pdctl embedded server", docs_url=None, redoc_url=None)
    add_error_handlers(app)
    add_admin(app, ctx)
    add_generate(app, ctx)
    add_completions(app, ctx)
    add_chat(app, ctx)
    add_models(app, ctx.model_name, ctx.max_context)
    if setup is not None:
        setup(app, ctx)
    describe(app, Document(f"pdctl {ctx.info.get('role', 'embedded')} server", ROUTES))
    return app
