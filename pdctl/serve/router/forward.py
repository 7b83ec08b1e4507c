"""How the router forwards one request: to a prefill and a decode server at once, with
`bootstrap_host`, `bootstrap_port` and a random 63-bit `bootstrap_room` added (an EPD
request goes to an encoder first). Decode's answer is the client's (streams pass
through); prefill's adds its side of the KV transfer. When a side fails, the error
names that side and the other side's request is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from pdctl.records import JSONValue, KVTransfer
from pdctl.serve.api.errors import error_body
from pdctl.serve.router.workers import RouterState, Worker

log = logging.getLogger("pdctl.serve")


class SideFailed(Exception):
    """A worker failed a request (side None: the router itself refused it)."""

    def __init__(self, side: Worker | None, message: str, status: int = 502) -> None:
        text = f"{side.role} {side.url} failed: {message}" if side else f"router: {message}"
        super().__init__(text)
        self.side, self.message, self.status = side, message, status

    def paired_with(self, other: Worker) -> SideFailed:
        """The same failure, naming the other side of the request too (which decode a
        prefill waited for is often the real culprit)."""
        return SideFailed(
            self.side, f"{self.message} (the request's {other.role}: {other.url})", self.status
        )


async def post(
    client: httpx.AsyncClient,
    worker: Worker,
    path: str,
    body: Mapping[str, JSONValue],
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST to a worker; SideFailed naming it when it cannot be reached or refuses."""
    try:
        response = await client.post(f"{worker.url}{path}", json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise SideFailed(worker, f"{type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        try:
            detail = response.json().get("error", {}).get("message", response.text)
        except (ValueError, AttributeError):
            detail = response.text
        status = response.status_code if response.status_code < 500 else 502
        raise SideFailed(worker, f"{response.status_code} {detail}", status)
    return response


def _with_bootstrap(body: Mapping[str, JSONValue], prefill: Worker) -> dict[str, JSONValue]:
    return {
        **body,
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": secrets.randbits(63),
    }


def failed_events(message: str, status: int) -> list[bytes]:
    """How a stream ends on a failure: the error as one event, then [DONE]."""
    body = json.dumps(error_body(message, status=status))
    return [f"data: {body}\n\n".encode(), b"data: [DONE]\n\n"]


def split_batch(body: Mapping[str, JSONValue], key: str) -> list[dict[str, JSONValue]] | None:
    """A batch body as one body per prompt, or None when it is one prompt."""
    value = body.get(key)
    if key == "input_ids" and isinstance(value, list) and value and isinstance(value[0], list):
        return [{**body, key: item} for item in value]
    if (
        key in ("text", "prompt")
        and isinstance(value, list)
        and value
        and all(isinstance(v, (str, list)) for v in value)
    ):
        if key == "prompt" and all(isinstance(v, int) for v in value):
            return None
        return [{**body, key: item} for item in value]
    return None


async def _encode(
    state: RouterState,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, JSONValue],
    prefill: Worker,
) -> tuple[dict[str, JSONValue], JSONValue]:
    """EPD: a request with images goes to an encoder first, which writes the embeddings
    into `prefill`'s pool. Returns the body that goes on (the expanded prompt instead of
    the images) and what the encoder moved, for the answer's meta_info."""
    if body.get("image") is None and body.get("images") is None:
        return body, None
    if path != "/generate":
        raise SideFailed(None, "images are taken on /generate only", 400)
    encoder = state.pick_encoder()
    if encoder is None:
        raise SideFailed(None, "this topology has no encoder for images", 400)
    room = secrets.randbits(63)
    request: dict[str, JSONValue] = {
        **body,
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.bootstrap_port,
        "embedding_room": room,
    }
    encoded = (await post(client, encoder, "/encode", request)).json()
    rest = {k: v for k, v in body.items() if k not in ("image", "images", "text", "input_ids")}
    routed: dict[str, JSONValue] = {
        **rest,
        "input_ids": encoded["input_ids"],
        "mm_items": encoded["mm_items"],
        "embedding_room": room,
    }
    return routed, encoded.get("embedding_transfer")


def _add_prefill_side(meta: dict[str, JSONValue], prefill_answer: JSONValue) -> None:
    """Decode's kv_transfer times the receive; prefill's times the send. Both go in
    the answer: `write_ms` (prefill gathering, digesting and writing, the part the
    staging kernels and the transport own) and `send_ms` (prefill's whole send,
    waits for decode's ring regions included), with `gather_ms` and `digest_ms`, the
    parts of write_ms spent gathering and taking digests."""
    sent = None
    if isinstance(prefill_answer, dict):
        prefill_meta = prefill_answer.get("meta_info")
        sent = prefill_meta.get("kv_transfer") if isinstance(prefill_meta, dict) else None
    if not isinstance(meta.get("kv_transfer"), dict) or not isinstance(sent, dict):
        return
    try:
        transfer = KVTransfer.from_json(meta["kv_transfer"], "decode's kv_transfer")
        transfer.add_prefill_side(KVTransfer.from_json(sent, "prefill's kv_transfer"))
    except ValueError as exc:  # the answer goes on as decode gave it
        log.warning("router: %s", exc)
        return
    meta["kv_transfer"] = transfer.to_json()


async def route_one(
    state: RouterState, client: httpx.AsyncClient, path: str, body: dict[str, JSONValue]
) -> Any:
    prefill, decode = state.pick()
    async with prefill.slot(), decode.slot():  # prefill's first, always (workers.py)
        body, embedding = await _encode(state, client, path, body, prefill)
        routed = _with_bootstrap({**body, "stream": False}, prefill)
        prefill_task = asyncio.create_task(post(client, prefill, path, routed))
        decode_task = asyncio.create_task(post(client, decode, path, routed))
        try:
            done, _ = await asyncio.wait(
                {prefill_task, decode_task}, return_when=asyncio.FIRST_EXCEPTION
            )
            for task in done:
                error = task.exception()
                if isinstance(error, SideFailed):
                    raise error.paired_with(decode if error.side is prefill else prefill)
                if error is not None:
                    raise error
            answer = (await decode_task).json()
            prefilled = await prefill_task
            meta = answer.get("meta_info")
            if isinstance(meta, dict):
                with contextlib.suppress(ValueError):  # decode's answer stands without it
                    _add_prefill_side(meta, prefilled.json())
                if embedding is not None:
                    meta["embedding_transfer"] = embedding
            return answer
        finally:
            for task in (prefill_task, decode_task):
                task.cancel()


async def route_stream(
    state: RouterState, client: httpx.AsyncClient, path: str, body: dict[str, JSONValue]
) -> AsyncIterator[bytes]:
    prefill, decode = state.pick()
    async with prefill.slot(), decode.slot():  # prefill's first, always (workers.py)
        try:
            body, _ = await _encode(state, client, path, body, prefill)
        except SideFailed as exc:
            for event in failed_events(str(exc), exc.status):
                yield event
            return
        routed = _with_bootstrap(body, prefill)
        prefill_task = asyncio.create_task(post(client, prefill, path, {**routed, "stream": False}))
        try:
            async with client.stream("POST", f"{decode.url}{path}", json=routed) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode(errors="replace")
                    raise SideFailed(decode, f"{response.status_code} {text}")
                async for chunk in response.aiter_raw():
                    if prefill_task.done() and prefill_task.exception() is not None:
                        raise prefill_task.exception()  # type: ignore[misc]
                    yield chunk
            await prefill_task
        except SideFailed as exc:
            for event in failed_events(str(exc), exc.status):
                yield event
        except httpx.HTTPError as exc:
            for event in failed_events(f"decode {decode.url} failed: {exc}", 502):
                yield event
        finally:
            prefill_task.cancel()


def merge_completions(parts: list[dict[str, JSONValue]]) -> dict[str, JSONValue]:
    """A batch's completions, one per prompt, as one: the first's fields, each one's
    choice at its index, the usage summed (a part that is no completion: TypeError)."""
    merged = dict(parts[0])
    merged["choices"] = [{**_first_choice(part), "index": i} for i, part in enumerate(parts)]
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for part in parts:
        counts = part.get("usage", {})
        if not isinstance(counts, dict):
            raise TypeError(f"a completion's usage is {counts!r}")
        for key in usage:
            usage[key] += int(_number(counts.get(key, 0)))
    merged["usage"] = dict(usage)
    return merged


def _first_choice(part: dict[str, JSONValue]) -> dict[str, JSONValue]:
    choices = part["choices"]
    first = choices[0] if isinstance(choices, list) else None
    if not isinstance(first, dict):
        raise TypeError(f"a completion's choices are {choices!r}")
    return first


def _number(value: JSONValue) -> int | float | str:
    if isinstance(value, (int, float, str)):
        return value  # int() takes it, as before: an int, a float, digits
    raise TypeError(f"a count is {value!r}")


async def forward_get(state: RouterState, client: httpx.AsyncClient, path: str) -> httpx.Response:
    """A GET a decode server answers for the topology (/v1/models: every server of a
    topology serves the same model)."""
    _, decode = state.pick()
    try:
        return await client.get(f"{decode.url}{path}")
    except httpx.HTTPError as exc:
        raise SideFailed(decode, f"{type(exc).__name__}: {exc}") from None
