"""What /v1/completions and /v1/chat/completions share: finish reasons, usage, the PD
check, and the chunk stream of one choice (text deltas with stop strings held back and
trimmed, a usage chunk when asked for)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request as HttpRequest

from pdctl.serve.api.answers import Chunk, Usage
from pdctl.serve.api.errors import BadRequest, error_body
from pdctl.serve.api.openai_schemas import OpenAIBody
from pdctl.serve.api.submission import Outcome, PDFields, ServerContext, Submission, sse
from pdctl.serve.api.text import TextStream, visible_text


def finish_reason(outcome: Outcome) -> str | None:
    if outcome.finish is None:
        return None
    return "length" if outcome.finish["type"] == "length" else "stop"


def usage(outcomes: list[Outcome]) -> Usage:
    prompt = sum(o.prompt_len for o in outcomes)
    completion = sum(len(o.tokens) for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def refuse_pd_batch(batch: bool, pd: PDFields | None) -> None:
    if batch and pd is not None:
        raise BadRequest(
            "PD requests carry one prompt each (the router splits batches)", "bootstrap_room"
        )


def final_text(ctx: ServerContext, body: OpenAIBody, outcome: Outcome) -> str:
    return visible_text(ctx.engine.tokenizer.decode(outcome.tokens), body.stops(), outcome.finish)


async def stream_choice(
    ctx: ServerContext,
    body: OpenAIBody,
    submission: Submission,
    http: HttpRequest,
    chunk: Callable[[str | None, str | None], Chunk],
    opening: bool = False,
) -> AsyncIterator[bytes]:
    """SSE chunks of one streamed choice: `chunk(delta, finish_reason)` shapes each
    (with `opening`, first an opening chunk, delta None); then, with include_usage, a
    chunk with `usage` and no choices; then [DONE]. Every chunk carries `usage: null`
    when usage is asked for."""
    stream = TextStream(body.stops())
    outcome = submission.outcome
    with_usage = body.include_usage

    def shaped(delta: str | None, finish: str | None) -> bytes:
        data = chunk(delta, finish)
        if with_usage:
            data["usage"] = None
        return sse(data)

    if opening:
        yield shaped(None, None)
    async for event in submission.events(http):
        if event.error is not None:
            yield sse(error_body(event.error))
            yield b"data: [DONE]\n\n"
            return
        delta = stream.delta(ctx.engine.tokenizer.decode(outcome.tokens), outcome.finish)
        if delta or outcome.finish is not None:
            yield shaped(delta, finish_reason(outcome))
    if with_usage:
        last = chunk("", None)
        last["choices"], last["usage"] = [], usage([outcome])
        yield sse(last)
    yield b"data: [DONE]\n\n"
