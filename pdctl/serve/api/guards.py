"""Request guards every HTTP server of pdctl shares (engine servers, router, bootstrap):
bodies bounded in size before they are read, JSON too deeply nested answered with a
400. Imports no torch: the router uses it and starts without the engine.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdctl.serve.api.errors import error_body

MAX_BODY_BYTES = 16 << 20


def refuse_oversized(request: HttpRequest, limit: int) -> tuple[int, str] | None:
    """(status, message) when a request's body is, or may be, larger than `limit` bytes.

    A body must declare its length: a chunked body could be any size, so it is refused
    before a byte of it is read.
    """
    length = request.headers.get("content-length")
    if length is None:
        if "transfer-encoding" in request.headers:
            return 411, "a request body must come with a Content-Length (chunked is refused)"
        return None
    if not length.isdigit() or int(length) > limit:
        return 413, f"request body larger than {limit} bytes"
    return None


def guard_json_depth(app: FastAPI) -> None:
    """JSON nested deeper than Python's recursion limit is a 400, not a crash; the errors
    Starlette and FastAPI answer themselves (a path no route matches, a body that is
    not JSON, a method a route lacks, a field that fails its declared type: a 400, not
    FastAPI's 422) come in the error body every other error has."""

    @app.exception_handler(RecursionError)
    async def _too_deep(_: HttpRequest, __: RecursionError) -> JSONResponse:
        return JSONResponse(error_body("the JSON body is nested too deeply"), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return JSONResponse(
            error_body(f"{where or 'body'}: {first.get('msg')}", where or None), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _own(_: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "bad request"
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the body is not valid JSON"
        body = error_body(message, status=exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
