"""OpenAI's POST /v1/chat/completions: the messages rendered with the model's chat
template (chat_template.py), then generated like a completion, plain or streamed
(`chat.completion.chunk`s: the assistant role first, then content deltas)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdctl.records import JSONValue
from pdctl.serve.api.answers import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatLogprobs,
    Chunk,
    Head,
    TokenLogprob,
)
from pdctl.serve.api.chat_template import TemplateError, render_chat
from pdctl.serve.api.errors import BadRequest
from pdctl.serve.api.openai_common import (
    final_text,
    finish_reason,
    stream_choice,
    usage,
)
from pdctl.serve.api.openai_schemas import ChatBody
from pdctl.serve.api.submission import (
    Outcome,
    ServerContext,
    Submission,
    pd_fields,
    sampling_params,
    validate_ids,
)


def template_messages(body: ChatBody) -> list[dict[str, JSONValue]]:
    """The messages as the template sees them: content as one text (text parts joined)."""
    messages: list[dict[str, JSONValue]] = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise BadRequest(
                        f"only text parts are supported, got type {part.type!r}",
                        f"messages[{i}].content[{j}]",
                    )
            content = "".join(part.text or "" for part in content)
        messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
    return messages


def chat_ids(ctx: ServerContext, body: ChatBody) -> list[int]:
    tokenizer = ctx.engine.tokenizer
    try:
        text = render_chat(
            template_messages(body), tokenizer.chat_template, tokenizer.special_tokens
        )
    except TemplateError as exc:
        raise BadRequest(f"the model's chat template refused the chat: {exc}", "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    validate_ids(ids, ctx.vocab_size, "messages")
    return ids


def chat_logprobs(ctx: ServerContext, outcome: Outcome) -> ChatLogprobs:
    decode = ctx.engine.tokenizer.decode

    def entry(token: int, logprob: float) -> TokenLogprob:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top]}
            for c in outcome.choices
        ]
    }


def max_tokens_of(ctx: ServerContext, body: ChatBody, prompt_len: int) -> int:
    for value in (body.max_completion_tokens, body.max_tokens):
        if value is not None:
            return value
    return max(ctx.max_context - prompt_len, 1)  # the engine names a prompt too long


async def chat(ctx: ServerContext, body: ChatBody, http: HttpRequest) -> Response:
    ids = chat_ids(ctx, body)
    params = sampling_params(body, max_tokens_of(ctx, body, len(ids)))
    if body.top_logprobs and not body.logprobs:  # as OpenAI answers it
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    model = body.model or ctx.model_name

    def head(kind: str) -> Head:
        return {"id": cid, "created": created, "model": model, "object": kind}

    submission = Submission(ctx, ids, params, cid, top, pd_fields(body))
    if body.stream:

        def chunk(delta: str | None, finish: str | None) -> Chunk:
            said = {"role": "assistant", "content": ""} if delta is None else {"content": delta}
            choice: ChatChunkChoice = {
                "index": 0,
                "delta": said if delta != "" or finish is None else {},
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**head("chat.completion.chunk"), "choices": [choice]}

        events = stream_choice(ctx, body, submission, http, chunk, opening=True)
        return StreamingResponse(events, media_type="text/event-stream")
    outcome = await submission.finish(http)
    choice: ChatChoice = {
        "index": 0,
        "message": {"role": "assistant", "content": final_text(ctx, body, outcome)},
        "logprobs": chat_logprobs(ctx, outcome) if body.logprobs else None,
        "finish_reason": finish_reason(outcome),
    }
    answer: ChatCompletion = {
        **head("chat.completion"),
        "choices": [choice],
        "usage": usage([outcome]),
    }
    return JSONResponse(answer)


def add_chat(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/chat/completions")
    async def _chat(body: ChatBody, http: HttpRequest) -> Response:
        return await chat(ctx, body, http)
