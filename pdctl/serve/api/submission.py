"""A request in the engine as the HTTP layer sees it: the server's context, one
submission with an asyncio queue of its events, and the outcome it adds up to.

A client that disconnects (or a cancelled handler) aborts its request, which gives
back its pages. Knows no endpoint: generate, completions and chat all submit here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request as HttpRequest

from pdctl.records import KVTransfer
from pdctl.serve.api.errors import BadRequest
from pdctl.serve.engine.loop import Engine
from pdctl.serve.engine.request import Event, FinishReason, Request
from pdctl.serve.engine.sampling import SamplingParams

DISCONNECT_CHECK_S = 0.5  # how often a request's reader asks whether its client is gone


@dataclass
class ServerContext:
    engine: Engine
    model_name: str
    vocab_size: int
    max_context: int
    info: dict[str, Any]
    extra_info: Callable[[], dict[str, object]] = field(default=lambda: {})  # serialized
    ready: bool = True
    # PD roles: check a request's bootstrap fields (None: it has none) and attach them
    # (may raise BadRequest)
    prepare: Callable[[Request, PDFields | None], None] | None = None
    # colocated: run the encoder in-process -> (prompt ids, [(offset, embedding rows)])
    encode: Callable[[Any, list[Any]], tuple[list[int], list[tuple[int, Any]]]] | None = None


@dataclass(frozen=True)
class PDFields:
    """The bootstrap fields a PD router added to a request (an EPD router also the
    expanded prompt's `mm_items` and the `embedding_room` prefill received them in)."""

    bootstrap_room: int
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    mm_items: list[dict[str, int]] | None = None
    embedding_room: int | None = None


@dataclass
class Outcome:
    rid: str
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    choices: list[Any] = field(default_factory=list)
    finish: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    kv_transfer: KVTransfer | None = None
    started: float = field(default_factory=time.monotonic)


class Sampled(Protocol):
    """A body's sampling fields: /generate's `sampling_params`, an OpenAI body."""

    temperature: float
    top_p: float
    top_k: int
    ignore_eos: bool
    stop_token_ids: list[int] | None
    seed: int | None

    def stops(self) -> list[str]: ...


def sampling_params(body: Sampled, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        max_new_tokens=max_new_tokens,
        top_p=body.top_p,
        top_k=body.top_k,
        ignore_eos=body.ignore_eos,
        stop=body.stops(),
        stop_token_ids=list(body.stop_token_ids or []),
        seed=body.seed,
    )


def validate_ids(ids: list[int], vocab: int, where: str) -> None:
    if not ids:
        raise BadRequest("the prompt is empty", where)
    for index, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise BadRequest(
                f"token {token} at {where}[{index}] is outside the vocabulary (0..{vocab - 1})",
                where,
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
        pd: PDFields | None = None,
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
        if ctx.prepare is not None:  # PD roles check the fields; a colocated server ignores them
            ctx.prepare(self.request, pd)
        ctx.engine.submit(self.request)

    def _deliver(self, loop: asyncio.AbstractEventLoop, event: Event) -> None:
        loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self, http: HttpRequest) -> AsyncIterator[Event]:
        """The request's events until it finishes. It is aborted (its pages given back)
        however the reading ends before that: the client gone (looked for every
        DISCONNECT_CHECK_S, tokens flowing or not), the handler cancelled, or the
        response closing this iterator when a write to a closed connection failed."""
        finished = False
        checked = time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.queue.get(), DISCONNECT_CHECK_S)
                except TimeoutError:
                    event = None
                if event is None or time.monotonic() - checked >= DISCONNECT_CHECK_S:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return
                if event is None:
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
                finished = event.error is not None or event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:  # a no-op for a request the engine already finished
                self.ctx.engine.abort(self.request.rid)

    async def finish(self, http: HttpRequest) -> Outcome:
        async for _ in self.events(http):
            pass
        if self.outcome.error:
            raise BadRequest(
                self.outcome.error, status=503 if "engine failed" in self.outcome.error else 400
            )
        return self.outcome


def pd_fields(body: Any) -> PDFields | None:
    """The bootstrap fields a PD router added, if any (with an EPD request's items)."""
    room = getattr(body, "bootstrap_room", None)
    if room is None:
        return None
    return PDFields(
        room,
        getattr(body, "bootstrap_host", None),
        getattr(body, "bootstrap_port", None),
        getattr(body, "mm_items", None),
        getattr(body, "embedding_room", None),
    )


def sse(data: object) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
