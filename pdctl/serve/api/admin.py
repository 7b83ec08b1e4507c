"""Service endpoints: /health, /health_generate, /get_model_info, /get_server_info,
/flush_cache and /metrics (Prometheus text)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pdctl.records import KVPool
from pdctl.serve.api.errors import BadRequest, error_body
from pdctl.serve.api.submission import ServerContext, Submission
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.sampling import SamplingParams


def engine_state(engine: Engine) -> dict[str, Any]:
    scheduler = engine.scheduler
    pages = scheduler.kv.pages
    return {
        "kv": KVPool(
            total_pages=pages.num_pages,
            free_pages=pages.num_free,
            cached_pages=scheduler.radix.num_cached_pages,
            extra={"page_size": scheduler.kv.page_size, "pool_tokens": scheduler.kv.pool_tokens},
        ).to_json(),
        "running_requests": len(scheduler.running),
        "waiting_requests": len(scheduler.waiting),
        "stats": vars(engine.stats).copy(),
    }


def prometheus(engine: Engine) -> str:
    state = engine_state(engine)
    lines = []
    for name, value in state["stats"].items():
        lines += [f"# TYPE pdctl_{name}_total counter", f"pdctl_{name}_total {value}"]
    gauges = {
        "running_requests": state["running_requests"],
        "waiting_requests": state["waiting_requests"],
        "kv_free_pages": state["kv"]["free_pages"],
        "kv_total_pages": state["kv"]["total_pages"],
        "kv_cached_pages": state["kv"]["cached_pages"],
    }
    for name, value in gauges.items():
        lines += [f"# TYPE pdctl_{name} gauge", f"pdctl_{name} {value}"]
    return "\n".join(lines) + "\n"


def not_ready() -> JSONResponse:
    return JSONResponse(error_body("not ready", status=503), status_code=503)


def add_health(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        if ctx.ready and ctx.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            error_body(ctx.engine.failed or "not ready", status=503), status_code=503
        )

    @app.get("/health_generate")
    async def health_generate(http: HttpRequest) -> Response:
        if not (ctx.ready and ctx.engine.alive):
            return not_ready()
        params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
        submission = Submission(ctx, [1], params, f"health-{uuid.uuid4().hex}", None)
        try:
            await asyncio.wait_for(submission.finish(http), timeout=30)
        except (TimeoutError, BadRequest) as exc:
            return JSONResponse(
                error_body(f"generation failed: {exc}", status=503), status_code=503
            )
        return JSONResponse({"status": "ok"})


def add_admin(app: FastAPI, ctx: ServerContext) -> None:
    add_health(app, ctx)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": ctx.model_name,
            "tokenizer_path": ctx.model_name,
            "is_generation": True,
            "vocab_size": ctx.vocab_size,
            "max_context": ctx.max_context,
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        def read() -> dict[str, Any]:
            return {**ctx.info, **engine_state(ctx.engine), **ctx.extra_info()}

        state: dict[str, Any] = await asyncio.to_thread(ctx.engine.call, read)
        return state

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        flushed = await asyncio.to_thread(ctx.engine.call, ctx.engine.scheduler.radix.flush)
        return {"success": True, "flushed_pages": flushed}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus(ctx.engine), media_type="text/plain; version=0.0.4")
