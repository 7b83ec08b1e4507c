"""The SGLang-compatible HTTP API of an embedded server (FastAPI on uvicorn).

Endpoints: /generate, /v1/completions (both with streaming), /health,
/health_generate, /get_model_info, /get_server_info, /flush_cache, /metrics.
Bad requests get a 4xx JSON error naming the field; the server keeps serving. A
client that disconnects aborts its request, which gives back its pages.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.request import Event, Request
from pdctl.serve.engine.sampling import SamplingParams
from pdctl.serve.guards import MAX_BODY_BYTES, guard_json_depth, refuse_oversized
from pdctl.serve.multimodal import PromptError, images_of
from pdctl.serve.schemas import CompletionBody, GenerateBody, SamplingBody, error_body


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass
class ServerContext:
    engine: Engine
    model_name: str
    vocab_size: int
    max_context: int
    info: dict[str, Any]
    extra_info: Callable[[], dict[str, Any]] = field(default=lambda: {})
    ready: bool = True
    # PD roles: check a request's bootstrap fields and attach them (may raise BadRequest)
    prepare: Callable[[Request, dict[str, Any]], None] | None = None
    # colocated: run the encoder in-process -> (prompt ids, [(offset, embedding rows)])
    encode: Callable[[Any, list[Any]], tuple[list[int], list[tuple[int, Any]]]] | None = None


@dataclass
class Outcome:
    rid: str
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    choices: list[Any] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    error: str | None = None
    cached_tokens: int = 0
    kv_transfer: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


def validate_ids(ids: list[int], vocab: int, where: str) -> None:
    if not ids:
        raise BadRequest("the prompt is empty", where)
    for index, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise BadRequest(
                f"token {token} at {where}[{index}] is outside the vocabulary (0..{vocab - 1})",
                where,
            )


def to_params(body: SamplingBody) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        max_new_tokens=body.max_new_tokens,
        top_p=body.top_p,
        top_k=body.top_k,
        ignore_eos=body.ignore_eos,
        stop=body.stops(),
        stop_token_ids=list(body.stop_token_ids or []),
        seed=body.seed,
    )


class Submission:
    """One request in the engine, with an asyncio queue of its events."""

    def __init__(
        self,
        ctx: ServerContext,
        ids: list[int],
        params: SamplingParams,
        rid: str,
        logprobs: int | None,
        pd: dict[str, Any] | None = None,
        embeds: list[tuple[int, Any]] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.ctx = ctx
        self.request = Request(
            rid,
            ids,
            params,
            sink=lambda event: self._deliver(loop, event),
            return_logprob=logprobs is not None,
            top_logprobs_num=logprobs or 0,
        )
        self.request.embeds = list(embeds or [])
        self.outcome = Outcome(rid, len(ids))
        if ctx.prepare is not None:
            ctx.prepare(self.request, pd or {})
        elif pd and pd.get("bootstrap_room") is not None:
            pass  # a colocated server accepts and ignores the PD fields
        ctx.engine.submit(self.request)

    def _deliver(self, loop: asyncio.AbstractEventLoop, event: Event) -> None:
        loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self, http: HttpRequest) -> AsyncIterator[Event]:
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except TimeoutError:
                    if await http.is_disconnected():
                        self.ctx.engine.abort(self.request.rid)
                        return
                    continue
                if event.token is not None:
                    self.outcome.tokens.append(event.token)
                    self.outcome.choices.append(event.choice)
                if event.error is not None:
                    self.outcome.error = event.error
                if event.finish_reason is not None:
                    self.outcome.finish = event.finish_reason
                    self.outcome.cached_tokens = self.request.cached_tokens
                    self.outcome.kv_transfer = self.request.kv_transfer
                yield event
                if event.error is not None or event.finish_reason is not None:
                    return
        except asyncio.CancelledError:
            self.ctx.engine.abort(self.request.rid)
            raise

    async def finish(self, http: HttpRequest) -> Outcome:
        async for _ in self.events(http):
            pass
        if self.outcome.error:
            raise BadRequest(
                self.outcome.error, status=503 if "engine failed" in self.outcome.error else 400
            )
        return self.outcome


def meta_info(ctx: ServerContext, outcome: Outcome, with_logprobs: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": outcome.rid,
        "prompt_tokens": outcome.prompt_len,
        "completion_tokens": len(outcome.tokens),
        "cached_tokens": outcome.cached_tokens,
        "finish_reason": outcome.finish,
        "e2e_latency": round(time.monotonic() - outcome.started, 6),
    }
    if outcome.kv_transfer:
        meta["kv_transfer"] = {k: v for k, v in outcome.kv_transfer.items() if k != "first"}
    if with_logprobs:
        meta["output_token_logprobs"] = [[c.logprob, c.token, None] for c in outcome.choices]
        meta["output_top_logprobs"] = [
            [[lp, tok, None] for tok, lp in c.top] for c in outcome.choices
        ]
        # pdctl's own: each chosen token's logit, so a margin can be read in ulps
        meta["output_token_logits"] = [c.logit for c in outcome.choices]
    return meta


def prompts_of(body: GenerateBody, ctx: ServerContext) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the body was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("give exactly one of text and input_ids", "text")
    tokenizer = ctx.engine.tokenizer
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise BadRequest("text is an empty list", "text")
        ids = [tokenizer.encode(t) for t in texts]
        batch = not isinstance(body.text, str)
    else:
        raw = body.input_ids or []
        batch = bool(raw) and isinstance(raw[0], list)
        ids = [list(x) for x in raw] if batch else [list(raw)]  # type: ignore[arg-type]
    for index, prompt in enumerate(ids):
        validate_ids(prompt, ctx.vocab_size, f"input_ids[{index}]" if batch else "input_ids")
    return ids, batch


async def multimodal_prompt(
    body: GenerateBody, ctx: ServerContext
) -> tuple[list[int], list[tuple[int, Any]]] | None:
    """A request with images, on a server that encodes them in-process: (prompt ids,
    [(offset, embedding rows)]); None when the body has no images."""
    try:
        images = images_of(body)
    except PromptError as exc:
        raise BadRequest(str(exc), exc.field) from None
    if not images:
        return None
    if ctx.encode is None:
        raise BadRequest(
            "this server runs no encoder: send images through the router of an EPD "
            "topology (roles.encoder), or to a colocated server",
            "images",
        )
    try:
        return await asyncio.to_thread(ctx.encode, body, images)
    except PromptError as exc:
        raise BadRequest(str(exc), exc.field) from None


def create_app(
    ctx: ServerContext, setup: Callable[[FastAPI, ServerContext], None] | None = None
) -> FastAPI:
    app = FastAPI(title="pdctl embedded server", docs_url=None, redoc_url=None)
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
            return JSONResponse(error_body("not ready", status=503), status_code=503)
        params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
        submission = Submission(ctx, [1], params, f"health-{uuid.uuid4().hex}", None)
        try:
            await asyncio.wait_for(submission.finish(http), timeout=30)
        except (TimeoutError, BadRequest) as exc:
            return JSONResponse(
                error_body(f"generation failed: {exc}", status=503), status_code=503
            )
        return JSONResponse({"status": "ok"})

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

    @app.post("/generate")
    async def generate(body: GenerateBody, http: HttpRequest) -> Response:
        multimodal = await multimodal_prompt(body, ctx)
        embeds = multimodal[1] if multimodal else []
        ids, batch = ([multimodal[0]], False) if multimodal else prompts_of(body, ctx)
        params = to_params(body.sampling_params)
        logprobs = body.top_logprobs_num if body.return_logprob else None
        pd = pd_fields(body)
        if batch and pd:
            raise BadRequest(
                "PD requests carry one prompt each (the router splits batches)", "bootstrap_room"
            )
        if body.stream:
            if batch:
                raise BadRequest("streaming takes one prompt, not a batch", "stream")
            submission = Submission(
                ctx, ids[0], params, body.rid or uuid.uuid4().hex, logprobs, pd, embeds
            )
            return StreamingResponse(
                stream_generate(ctx, submission, http, body.return_logprob),
                media_type="text/event-stream",
            )
        submissions = [
            Submission(
                ctx,
                prompt,
                params,
                body.rid if body.rid and not batch else uuid.uuid4().hex,
                logprobs,
                pd,
                embeds,
            )
            for prompt in ids
        ]
        outcomes = await asyncio.gather(*(s.finish(http) for s in submissions))
        results = [
            {
                "text": ctx.engine.tokenizer.decode(o.tokens),
                "output_ids": o.tokens,
                "meta_info": meta_info(ctx, o, body.return_logprob),
            }
            for o in outcomes
        ]
        return JSONResponse(results if batch else results[0])

    from pdctl.serve.openai import add_completions

    add_completions(app, ctx)
    if setup is not None:
        setup(app, ctx)
    return app


async def stream_generate(
    ctx: ServerContext, submission: Submission, http: HttpRequest, logprobs: bool
) -> AsyncIterator[bytes]:
    async for event in submission.events(http):
        if event.error is not None:
            yield sse(error_body(event.error, status=400))
            break
        outcome = submission.outcome
        chunk = {
            "text": ctx.engine.tokenizer.decode(outcome.tokens),
            "output_ids": outcome.tokens,
            "meta_info": meta_info(ctx, outcome, logprobs),
        }
        yield sse(chunk)
    yield b"data: [DONE]\n\n"


def pd_fields(body: Any) -> dict[str, Any]:
    """The bootstrap fields a PD router added, if any (with an EPD request's items)."""
    names = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "mm_items", "embedding_room")
    fields = {k: getattr(body, k, None) for k in names}
    return fields if fields["bootstrap_room"] is not None else {}


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def engine_state(engine: Engine) -> dict[str, Any]:
    scheduler = engine.scheduler
    pages = scheduler.kv.pages
    return {
        "kv": {
            "total_pages": pages.num_pages,
            "free_pages": pages.num_free,
            "cached_pages": scheduler.radix.num_cached_pages,
            "page_size": scheduler.kv.page_size,
            "pool_tokens": scheduler.kv.pool_tokens,
        },
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


def completion_ids(body: CompletionBody, ctx: ServerContext) -> tuple[list[list[int]], bool]:
    prompt = body.prompt
    tokenizer = ctx.engine.tokenizer
    if isinstance(prompt, str):
        ids, batch = [tokenizer.encode(prompt)], False
    elif prompt and all(isinstance(p, str) for p in prompt):
        ids, batch = [tokenizer.encode(p) for p in prompt], True  # type: ignore[arg-type]
    elif prompt and all(isinstance(p, list) for p in prompt):
        ids, batch = [list(p) for p in prompt], True  # type: ignore[arg-type]
    else:
        ids, batch = [list(prompt)], False  # type: ignore[arg-type]
    for index, one in enumerate(ids):
        validate_ids(one, ctx.vocab_size, f"prompt[{index}]" if batch else "prompt")
    return ids, batch
