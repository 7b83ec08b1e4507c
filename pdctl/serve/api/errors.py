"""The one error of the HTTP API and its JSON body (OpenAI's shape, SGLang's too).

Torch-free: the router and the bootstrap endpoint answer with the same body.
"""

from __future__ import annotations

from typing import TypedDict


class BadRequest(Exception):
    """A request the server refuses: `message` names what is wrong, `param` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


class ErrorDetail(TypedDict):
    message: str
    type: str  # BadRequestError, NotFoundError or ServiceUnavailableError
    param: str | None
    code: int  # the HTTP status


class ErrorJSON(TypedDict):
    """The body of every error (openapi.py documents it as `ErrorBody`)."""

    error: ErrorDetail


def error_body(message: str, param: str | None = None, status: int = 400) -> ErrorJSON:
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError"
    if status in (404, 405):
        kind = "NotFoundError"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
