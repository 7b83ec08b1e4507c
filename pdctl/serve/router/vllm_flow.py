"""vLLM's PD flow through the builtin router (`--pd-flow vllm`): prefill, then decode.

1. The request goes to a prefill server as it came, but with `max_tokens` (and a
   chat's `max_completion_tokens`) 1, no streaming, and `kv_transfer_params:
   {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`, under an
   `X-Request-Id` (the client's, or a new one).
2. Prefill answers with the `kv_transfer_params` decode needs to pull the KV (its
   engine id, block ids, side channel).
3. The original request goes to a decode server with those parameters, under the same
   `X-Request-Id`; decode's answer, or its stream, is the client's.

Decode is asked only once prefill answered, so a prefill that fails (or answers
without `kv_transfer_params`: a server that is no `kv_producer`) answers the client
with the cause, naming prefill, and nothing waits for a transfer that never starts.
A request holds a slot on its prefill server while prefill runs, then one on decode.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from pdctl.records import JSONValue
from pdctl.serve.router.forward import SideFailed, failed_events, post
from pdctl.serve.router.workers import RouterState, Worker

REMOTE_DECODE: dict[str, JSONValue] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: Mapping[str, JSONValue]) -> dict[str, JSONValue]:
    """What prefill computes: the prompt, one token, no stream, KV kept for decode."""
    routed = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    routed |= {"max_tokens": 1, "stream": False, "kv_transfer_params": dict(REMOTE_DECODE)}
    if "max_completion_tokens" in body:
        routed["max_completion_tokens"] = 1
    return routed


def request_id(headers: Mapping[str, str]) -> str:
    given = headers.get("x-request-id")
    return given if given and len(given) <= 128 and given.isprintable() else str(uuid.uuid4())


async def prefilled(
    state: RouterState,
    client: httpx.AsyncClient,
    path: str,
    body: Mapping[str, JSONValue],
    rid: str,
) -> tuple[Worker, dict[str, JSONValue]]:
    """Step 1 and 2: the decode worker's body, with prefill's kv_transfer_params."""
    prefill, decode = state.pick()
    async with prefill.slot():
        answer = await post(client, prefill, path, prefill_body(body), {"x-request-id": rid})
    try:
        params = answer.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict):
        raise SideFailed(
            prefill,
            "answered without kv_transfer_params (is it a vLLM kv_producer with a KV connector?)",
        )
    return decode, {**body, "kv_transfer_params": params}


async def route_one(
    state: RouterState,
    client: httpx.AsyncClient,
    path: str,
    body: Mapping[str, JSONValue],
    headers: Mapping[str, str],
) -> Any:
    rid = request_id(headers)
    decode, routed = await prefilled(state, client, path, {**body, "stream": False}, rid)
    async with decode.slot():
        answer = await post(client, decode, path, routed, {"x-request-id": rid})
    return answer.json()


async def stream_from_decode(
    client: httpx.AsyncClient, decode: Worker, path: str, routed: dict[str, JSONValue], rid: str
) -> AsyncIterator[bytes]:
    """Step 3 streamed: decode's events as they come; a failure as one error event."""
    async with decode.slot():
        try:
            async with client.stream(
                "POST", f"{decode.url}{path}", json=routed, headers={"x-request-id": rid}
            ) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode(errors="replace")
                    raise SideFailed(decode, f"{response.status_code} {text[:500]}")
                async for chunk in response.aiter_raw():
                    yield chunk
        except SideFailed as exc:
            for event in failed_events(str(exc), exc.status):
                yield event
        except httpx.HTTPError as exc:
            for event in failed_events(f"decode {decode.url} failed: {exc}", 502):
                yield event
