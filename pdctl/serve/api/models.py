"""OpenAI's GET /v1/models and /v1/models/{id}: the one model this server serves, under
the name it was started with (a preset's name or the checkpoint's path)."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel

from pdctl.serve.api.errors import BadRequest

STARTED = int(time.time())


class ModelCard(BaseModel):
    """One model, as OpenAI describes it, with vLLM's `max_model_len`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdctl"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def model_card(name: str, max_context: int) -> ModelCard:
    return ModelCard(id=name, created=STARTED, root=name, max_model_len=max_context)


def add_models(app: FastAPI, name: str, max_context: int) -> None:
    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card(name, max_context)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        if model_id != name:
            raise BadRequest(
                f"no model {model_id!r} here; this server serves {name!r}", "model", status=404
            )
        return model_card(name, max_context)
