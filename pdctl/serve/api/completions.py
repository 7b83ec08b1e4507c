"""OpenAI's POST /v1/completions: a prompt (text, token ids, or a batch of either),
plain or streamed, with logprobs, stop strings and usage."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdctl.serve.api.answers import Chunk, Completion, CompletionChoice, CompletionLogprobs, Head
from pdctl.serve.api.errors import BadRequest
from pdctl.serve.api.openai_common import (
    final_text,
    finish_reason,
    refuse_pd_batch,
    stream_choice,
    usage,
)
from pdctl.serve.api.openai_schemas import CompletionBody
from pdctl.serve.api.submission import (
    Outcome,
    ServerContext,
    Submission,
    pd_fields,
    sampling_params,
    validate_ids,
)


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


def logprobs_of(ctx: ServerContext, outcome: Outcome) -> CompletionLogprobs:
    decode = ctx.engine.tokenizer.decode
    return {
        "tokens": [decode([t]) for t in outcome.tokens],
        "token_logprobs": [c.logprob for c in outcome.choices],
        "top_logprobs": [{decode([t]): lp for t, lp in c.top} for c in outcome.choices],
        "text_offset": [],
    }


async def completions(ctx: ServerContext, body: CompletionBody, http: HttpRequest) -> Response:
    ids, batch = completion_ids(body, ctx)
    params = sampling_params(body, 16 if body.max_tokens is None else body.max_tokens)
    pd = pd_fields(body)
    refuse_pd_batch(batch, pd)
    if body.stream and batch:
        raise BadRequest("streaming takes one prompt, not a batch", "stream")
    head: Head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model or ctx.model_name,
    }
    submissions = [
        Submission(ctx, one, params, f"{head['id']}-{i}", body.logprobs, pd)
        for i, one in enumerate(ids)
    ]
    if body.stream:

        def chunk(delta: str | None, finish: str | None) -> Chunk:
            choice: CompletionChoice = {
                "index": 0,
                "text": delta or "",
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**head, "choices": [choice]}

        events = stream_choice(ctx, body, submissions[0], http, chunk)
        return StreamingResponse(events, media_type="text/event-stream")
    outcomes = await asyncio.gather(*(s.finish(http) for s in submissions))
    choices: list[CompletionChoice] = [
        {
            "index": i,
            "text": final_text(ctx, body, o),
            "logprobs": logprobs_of(ctx, o) if body.logprobs is not None else None,
            "finish_reason": finish_reason(o),
        }
        for i, o in enumerate(outcomes)
    ]
    answer: Completion = {**head, "choices": choices, "usage": usage(outcomes)}
    return JSONResponse(answer)


def add_completions(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions")
    async def _completions(body: CompletionBody, http: HttpRequest) -> Response:
        return await completions(ctx, body, http)
