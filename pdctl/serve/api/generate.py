"""SGLang's POST /generate: text or token ids (one prompt or a batch), images on a
server that encodes them, streaming, logprobs, and the PD fields a router adds.

The answer's `text` ends before a matched stop string unless `no_stop_trim`;
`output_ids` are every token generated.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdctl.serve.api.answers import GenerateResult, MetaInfo
from pdctl.serve.api.errors import BadRequest, error_body
from pdctl.serve.api.schemas import GenerateBody
from pdctl.serve.api.submission import (
    Outcome,
    ServerContext,
    Submission,
    pd_fields,
    sampling_params,
    sse,
    validate_ids,
)
from pdctl.serve.api.text import visible_text
from pdctl.serve.multimodal import PromptError, images_of


def meta_info(outcome: Outcome, with_logprobs: bool) -> MetaInfo:
    meta: MetaInfo = {
        "id": outcome.rid,
        "prompt_tokens": outcome.prompt_len,
        "completion_tokens": len(outcome.tokens),
        "cached_tokens": outcome.cached_tokens,
        "finish_reason": outcome.finish,
        "e2e_latency": round(time.monotonic() - outcome.started, 6),
    }
    if outcome.kv_transfer is not None:
        meta["kv_transfer"] = outcome.kv_transfer.to_json()
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


def result_of(ctx: ServerContext, body: GenerateBody, outcome: Outcome) -> GenerateResult:
    sampling = body.sampling_params
    text = visible_text(
        ctx.engine.tokenizer.decode(outcome.tokens),
        sampling.stops(),
        outcome.finish,
        trim=not sampling.no_stop_trim,
    )
    return {
        "text": text,
        "output_ids": outcome.tokens,
        "meta_info": meta_info(outcome, body.return_logprob),
    }


async def generate(ctx: ServerContext, body: GenerateBody, http: HttpRequest) -> Response:
    multimodal = await multimodal_prompt(body, ctx)
    embeds = multimodal[1] if multimodal else []
    ids, batch = ([multimodal[0]], False) if multimodal else prompts_of(body, ctx)
    params = sampling_params(body.sampling_params, body.sampling_params.max_new_tokens)
    logprobs = body.top_logprobs_num if body.return_logprob else None
    pd = pd_fields(body)
    if batch and pd:
        raise BadRequest(
            "PD requests carry one prompt each (the router splits batches)", "bootstrap_room"
        )
    if body.stream and batch:
        raise BadRequest("streaming takes one prompt, not a batch", "stream")
    rids = [body.rid if body.rid and not batch else uuid.uuid4().hex for _ in ids]
    submissions = [
        Submission(ctx, prompt, params, rid, logprobs, pd, embeds)
        for prompt, rid in zip(ids, rids, strict=True)
    ]
    if body.stream:
        return StreamingResponse(
            stream_generate(ctx, body, submissions[0], http), media_type="text/event-stream"
        )
    outcomes = await asyncio.gather(*(s.finish(http) for s in submissions))
    results = [result_of(ctx, body, o) for o in outcomes]
    return JSONResponse(results if batch else results[0])


async def stream_generate(
    ctx: ServerContext, body: GenerateBody, submission: Submission, http: HttpRequest
) -> AsyncIterator[bytes]:
    async for event in submission.events(http):
        if event.error is not None:
            yield sse(error_body(event.error, status=400))
            break
        yield sse(result_of(ctx, body, submission.outcome))
    yield b"data: [DONE]\n\n"


def add_generate(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/generate")
    async def _generate(body: GenerateBody, http: HttpRequest) -> Response:
        return await generate(ctx, body, http)
