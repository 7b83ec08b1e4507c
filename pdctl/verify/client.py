"""One verify request over HTTP, and what came back (or why nothing did).

The request is phrased, and the answer read, in the engine's dialect
(`engines.dialect`): `/generate` for pdctl's servers and SGLang, OpenAI completions
with token ids for vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypedDict

import httpx

from pdctl.engines.dialect import AnswerError, Dialect, GenerateDialect
from pdctl.records import JSONValue, KVTransfer, ServerInfo
from pdctl.verify.workload import Prompt

TOP = 5


class ResultJson(TypedDict):
    """One request's answer as verify's JSON report gives it."""

    id: str
    kind: str
    ok: bool
    status: int | None
    output_ids: list[int]
    cached_tokens: int
    kv_transfer: dict[str, JSONValue] | None
    embedding_transfer: JSONValue
    latency_ms: float
    error: str | None
    transfer_proven: str | None  # the engine's accounting that proved its transfer


@dataclass
class Result:
    prompt: Prompt
    ok: bool
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per position, best first
    logits: list[float | None] = field(default_factory=list)  # per position, the chosen token's
    cached_tokens: int = 0
    kv_transfer: KVTransfer | None = None
    embedding_transfer: JSONValue = None  # EPD: what the encoder wrote to prefill
    latency_ms: float = 0.0
    error: str | None = None
    status: int | None = None
    transfer_proven: str | None = None  # the engine's accounting that proved its transfer

    def to_json(self) -> ResultJson:
        return {
            "id": self.prompt.id,
            "kind": self.prompt.kind,
            "ok": self.ok,
            "status": self.status,
            "output_ids": self.output_ids,
            "cached_tokens": self.cached_tokens,
            "kv_transfer": None if self.kv_transfer is None else self.kv_transfer.to_json(),
            "embedding_transfer": self.embedding_transfer,
            "latency_ms": round(self.latency_ms, 2),
            "error": self.error,
            "transfer_proven": self.transfer_proven,
        }


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or body)[:500]


def generate(
    client: httpx.Client,
    url: str,
    prompt: Prompt,
    max_new_tokens: int,
    timeout: float,
    dialect: Dialect = GenerateDialect(),
) -> Result:
    started = time.perf_counter()
    try:
        path, body = dialect.request(prompt.body(), max_new_tokens, TOP)
    except AnswerError as exc:
        return Result(prompt, False, error=str(exc))
    try:
        response = client.post(f"{url}{path}", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return Result(
            prompt,
            False,
            latency_ms=(time.perf_counter() - started) * 1e3,
            error=f"no answer within {timeout:g} s",
        )
    except httpx.HTTPError as exc:
        return Result(
            prompt,
            False,
            latency_ms=(time.perf_counter() - started) * 1e3,
            error=f"the router at {url} is unreachable: {type(exc).__name__}: {exc}",
        )
    latency = (time.perf_counter() - started) * 1e3
    if response.status_code != 200:
        return Result(
            prompt,
            False,
            latency_ms=latency,
            error=_error_text(response),
            status=response.status_code,
        )
    return _answer(prompt, response, latency, max_new_tokens, dialect)


def _answer(
    prompt: Prompt, response: httpx.Response, latency: float, wanted: int, dialect: Dialect
) -> Result:
    """A 200 answer read into a Result; one without output tokens fails its request."""
    try:
        answer = dialect.read(response.json())
    except ValueError as exc:  # not JSON, or not an answer of this dialect
        what = exc if isinstance(exc, AnswerError) else "the answer is not JSON"
        return Result(
            prompt, False, latency_ms=latency, status=200, error=f"{what}: {response.text[:200]!r}"
        )
    if not answer.output_ids and wanted > 0:
        return Result(
            prompt,
            False,
            latency_ms=latency,
            status=200,
            kv_transfer=answer.kv_transfer,
            error=f"the answer carried no output tokens ({wanted} asked for; finish reason "
            f"{answer.finish_reason})",
        )
    return Result(
        prompt,
        True,
        output_ids=answer.output_ids,
        logprobs=answer.logprobs,
        top=answer.top,
        logits=answer.logits,
        cached_tokens=answer.cached_tokens,
        kv_transfer=answer.kv_transfer,
        embedding_transfer=answer.embedding_transfer,
        latency_ms=latency,
        status=200,
    )


@dataclass(frozen=True)
class ServedModel:
    """What the servers say of what they serve (None where none said)."""

    vocab_size: int | None = None  # the smallest any server reported
    max_context: int | None = None  # likewise: the longest prompt plus answer it takes
    dtype: str | None = None  # the compute dtype, when every server that said agrees
    deterministic: bool | None = None  # True only when every server that said is


def _get(client: httpx.Client, url: str) -> dict[str, JSONValue]:
    try:
        body = client.get(url, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def served_model(client: httpx.Client, urls: list[str]) -> ServedModel:
    """Ask each server (`/get_model_info`, `/get_server_info`) about its model."""
    sizes: dict[str, list[int]] = {"vocab_size": [], "max_context": []}
    dtypes: set[str] = set()
    modes: set[bool] = set()
    for url in urls:
        listed = _get(client, f"{url}/v1/models").get("data")  # OpenAI servers (vLLM)
        if isinstance(listed, list) and listed and isinstance(listed[0], dict):
            longest = listed[0].get("max_model_len")
            if isinstance(longest, int) and not isinstance(longest, bool) and longest > 0:
                sizes["max_context"].append(longest)
        model = _get(client, f"{url}/get_model_info")
        for key, found in sizes.items():
            value = model.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(value)
        try:
            info = ServerInfo.from_json(_get(client, f"{url}/get_server_info"))
        except ValueError:  # another engine's server: nothing learnt from it
            info = ServerInfo()
        if info.dtype is not None and info.dtype != "auto":
            dtypes.add(info.dtype)
        if info.deterministic is not None:
            modes.add(info.deterministic)
    return ServedModel(
        min(sizes["vocab_size"], default=None),
        min(sizes["max_context"], default=None),
        dtypes.pop() if len(dtypes) == 1 else None,
        (modes == {True}) if modes else None,
    )


def flush(client: httpx.Client, urls: list[str], path: str = "/flush_cache") -> list[str]:
    """POST `path` (the dialect's cache flush) to each server; problems, if any (a router
    may not have it; vLLM answers success false while blocks are held)."""
    problems = []
    for url in urls:
        try:
            response = client.post(f"{url}{path}", timeout=30)
            if response.status_code >= 400:
                problems.append(f"{url}{path} answered {response.status_code}")
            elif _json(response).get("success") is False:
                problems.append(f"{url}{path} answered success false (blocks still held)")
        except httpx.HTTPError as exc:
            problems.append(f"{url}{path}: {type(exc).__name__}")
    return problems


def _json(response: httpx.Response) -> dict[str, JSONValue]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
