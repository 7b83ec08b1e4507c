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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from pdctl.serve.api.admin import add_admin
from pdctl.serve.api.chat import add_chat
from pdctl.serve.api.completions import add_completions
from pdctl.serve.api.errors import BadRequest, error_body
from pdctl.serve.api.generate import add_generate
from pdctl.serve.api.guards import MAX_BODY_BYTES, guard_json_depth, refuse_oversized
from pdctl.serve.api.models import add_models
from pdctl.serve.api.submission import ServerContext


def add_error_handlers(app: FastAPI) -> None:
    guard_json_depth(app)

    @app.exception_handler(BadRequest)
    async def _bad(_: HttpRequest, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.param, exc.status), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return JSONResponse(
            error_body(f"{where or 'body'}: {first.get('msg')}", where or None), status_code=400
        )

    @app.middleware("http")
    async def _limit(request: HttpRequest, call_next: Callable[[HttpRequest], Any]) -> Response:
        refused = refuse_oversized(request, MAX_BODY_BYTES)
        if refused is not None:
            return JSONResponse(error_body(refused[1]), status_code=refused[0])
        response: Response = await call_next(request)
        return response


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
    return app
