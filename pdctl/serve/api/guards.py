"""Request guards every HTTP server of pdctl shares (engine servers, router, bootstrap):
bodies bounded in size before they are read, JSON too deeply nested answered with a
400. Imports no torch: the router uses it and starts without the engine.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

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
    """JSON nested deeper than Python's recursion limit is a 400, not a crash."""

    @app.exception_handler(RecursionError)
    async def _too_deep(_: HttpRequest, __: RecursionError) -> JSONResponse:
        return JSONResponse(error_body("the JSON body is nested too deeply"), status_code=400)
