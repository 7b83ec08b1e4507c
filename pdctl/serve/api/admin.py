"""Service endpoints: /health, /health_generate, /get_model_info, /get_server_info,
/flush_cache and /metrics (Prometheus text)."""

from __future__ import annotations

import asyncio
import copy
import uuid
from dataclasses import asdict, dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from pdctl.records import JSONValue, KVPool
from pdctl.serve.api.errors import BadRequest, error_body
from pdctl.serve.api.submission import ServerContext, Submission
from pdctl.serve.engine.loop import Engine, Stats
from pdctl.serve.engine.sampling import SamplingParams


@dataclass(frozen=True)
class EngineState:
    """The engine's pages, requests and counters at one moment."""

    kv: KVPool
    running_requests: int
    waiting_requests: int
    stats: Stats

    @classmethod
    def of(cls, engine: Engine) -> EngineState:
        scheduler = engine.scheduler
        pages, kv = scheduler.kv.pages, scheduler.kv
        pool = KVPool(
            total_pages=pages.num_pages,
            free_pages=pages.num_free,
            cached_pages=scheduler.radix.num_cached_pages,
            extra={"page_size": kv.page_size, "pool_tokens": kv.pool_tokens},
        )
        running, waiting = len(scheduler.running), len(scheduler.waiting)
        return cls(pool, running, waiting, copy.copy(engine.stats))

    def to_json(self) -> dict[str, JSONValue]:
        """As /get_server_info has it."""
        return {
            "kv": self.kv.to_json(),
            "running_requests": self.running_requests,
            "waiting_requests": self.waiting_requests,
            "stats": asdict(self.stats),
        }


class ModelInfo(BaseModel):
    """SGLang's /get_model_info."""

    model_path: str
    tokenizer_path: str
    is_generation: bool
    vocab_size: int
    max_context: int


class Flushed(BaseModel):
    """/flush_cache: the radix cache's pages given back."""

    success: bool
    flushed_pages: int


def prometheus(engine: Engine) -> str:
    state = EngineState.of(engine)
    lines = []
    for name, value in asdict(state.stats).items():
        lines += [f"# TYPE pdctl_{name}_total counter", f"pdctl_{name}_total {value}"]
    gauges = {
        "running_requests": state.running_requests,
        "waiting_requests": state.waiting_requests,
        "kv_free_pages": state.kv.free_pages,
        "kv_total_pages": state.kv.total_pages,
        "kv_cached_pages": state.kv.cached_pages,
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
    async def model_info() -> ModelInfo:
        name = ctx.model_name
        return ModelInfo(
            model_path=name,
            tokenizer_path=name,
            is_generation=True,
            vocab_size=ctx.vocab_size,
            max_context=ctx.max_context,
        )

    @app.get("/get_server_info")
    async def server_info() -> dict[str, object]:  # the role's info, serialized only
        def read() -> dict[str, object]:
            return {**ctx.info, **EngineState.of(ctx.engine).to_json(), **ctx.extra_info()}

        return await asyncio.to_thread(ctx.engine.call, read)

    @app.post("/flush_cache")
    async def flush_cache() -> Flushed:
        flushed = await asyncio.to_thread(ctx.engine.call, ctx.engine.scheduler.radix.flush)
        return Flushed(success=True, flushed_pages=flushed)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus(ctx.engine), media_type="text/plain; version=0.0.4")
