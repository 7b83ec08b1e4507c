"""OpenAI-compatible /v1/completions (with streaming) on top of the engine."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdctl.serve.engine.sampling import SamplingParams
from pdctl.serve.http import (
    BadRequest,
    Outcome,
    ServerContext,
    Submission,
    completion_ids,
    pd_fields,
    sse,
)
from pdctl.serve.schemas import CompletionBody, error_body


def _params(body: CompletionBody) -> SamplingParams:
    stops = (
        [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else list(body.stop)
    )
    return SamplingParams(
        temperature=body.temperature,
        max_new_tokens=body.max_tokens,
        top_p=body.top_p,
        ignore_eos=body.ignore_eos,
        stop=stops,
        seed=body.seed,
    )


def _finish(outcome: Outcome) -> str | None:
    if outcome.finish is None:
        return None
    return "length" if outcome.finish.get("type") == "length" else "stop"


def _logprobs(ctx: ServerContext, outcome: Outcome) -> dict[str, Any]:
    decode = ctx.engine.tokenizer.decode
    return {
        "tokens": [decode([t]) for t in outcome.tokens],
        "token_logprobs": [c.logprob for c in outcome.choices],
        "top_logprobs": [{decode([t]): lp for t, lp in c.top} for c in outcome.choices],
        "text_offset": [],
    }


def add_completions(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest) -> Response:
        ids, batch = completion_ids(body, ctx)
        params = _params(body)
        pd = pd_fields(body)
        if batch and pd:
            raise BadRequest(
                "PD requests carry one prompt each (the router splits batches)", "bootstrap_room"
            )
        created = int(time.time())
        cid = f"cmpl-{uuid.uuid4().hex}"
        model = body.model or ctx.model_name
        if body.stream:
            if batch:
                raise BadRequest("streaming takes one prompt, not a batch", "stream")
            submission = Submission(ctx, ids[0], params, cid, body.logprobs, pd)
            return StreamingResponse(
                _stream(ctx, submission, http, cid, created, model), media_type="text/event-stream"
            )
        submissions = [
            Submission(ctx, one, params, f"{cid}-{i}", body.logprobs, pd)
            for i, one in enumerate(ids)
        ]
        outcomes = await asyncio.gather(*(s.finish(http) for s in submissions))
        choices = [
            {
                "index": i,
                "text": ctx.engine.tokenizer.decode(o.tokens),
                "logprobs": _logprobs(ctx, o) if body.logprobs is not None else None,
                "finish_reason": _finish(o),
            }
            for i, o in enumerate(outcomes)
        ]
        prompt_tokens = sum(o.prompt_len for o in outcomes)
        completion_tokens = sum(len(o.tokens) for o in outcomes)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )


async def _stream(
    ctx: ServerContext,
    submission: Submission,
    http: HttpRequest,
    cid: str,
    created: int,
    model: str,
) -> AsyncIterator[bytes]:
    sent = ""
    async for event in submission.events(http):
        if event.error is not None:
            yield sse(error_body(event.error))
            break
        text = ctx.engine.tokenizer.decode(submission.outcome.tokens)
        delta, sent = text[len(sent) :], text
        chunk = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": delta,
                    "logprobs": None,
                    "finish_reason": _finish(submission.outcome),
                }
            ],
        }
        yield sse(chunk)
    yield b"data: [DONE]\n\n"
