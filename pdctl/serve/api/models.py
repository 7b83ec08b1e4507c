"""OpenAI's GET /v1/models and /v1/models/{id}: the one model this server serves, under
the name it was started with (a preset's name or the checkpoint's path)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from pdctl.serve.api.errors import BadRequest

STARTED = int(time.time())


def model_card(name: str, max_context: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": STARTED,
        "owned_by": "pdctl",
        "root": name,
        "max_model_len": max_context,
    }


def add_models(app: FastAPI, name: str, max_context: int) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name, max_context)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != name:
            raise BadRequest(
                f"no model {model_id!r} here; this server serves {name!r}", "model", status=404
            )
        return model_card(name, max_context)
