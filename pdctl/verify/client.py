"""One verify request over HTTP, and what came back (or why nothing did)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdctl.records import KVTransfer, ServerInfo
from pdctl.verify.workload import Prompt

TOP = 5


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
    embedding_transfer: dict[str, Any] | None = None  # EPD: what the encoder wrote to prefill
    latency_ms: float = 0.0
    error: str | None = None
    status: int | None = None

    def to_json(self) -> dict[str, Any]:
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
        }


def request_body(prompt: Prompt, max_new_tokens: int) -> dict[str, Any]:
    return {
        **prompt.body(),
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": TOP,
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
    client: httpx.Client, url: str, prompt: Prompt, max_new_tokens: int, timeout: float
) -> Result:
    started = time.perf_counter()
    try:
        response = client.post(
            f"{url}/generate", json=request_body(prompt, max_new_tokens), timeout=timeout
        )
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
    return _answer(prompt, response, latency, max_new_tokens)


def _answer(prompt: Prompt, response: httpx.Response, latency: float, wanted: int) -> Result:
    """A 200 answer read into a Result; one without output tokens fails its request."""
    try:
        body = response.json()
    except ValueError:
        return Result(prompt, False, latency_ms=latency, status=200,
                      error=f"the answer is not JSON: {response.text[:200]!r}")  # fmt: skip
    meta = body.get("meta_info", {}) if isinstance(body, dict) else {}
    output_ids = list(body.get("output_ids") or []) if isinstance(body, dict) else []
    try:
        transfer = None
        if meta.get("kv_transfer") is not None:
            transfer = KVTransfer.from_json(meta["kv_transfer"], "meta_info.kv_transfer")
    except ValueError as exc:
        return Result(prompt, False, latency_ms=latency, status=200, error=f"the answer's {exc}")
    if not output_ids and wanted > 0:
        return Result(
            prompt,
            False,
            latency_ms=latency,
            status=200,
            kv_transfer=transfer,
            error=f"the answer carried no output tokens ({wanted} asked for; finish reason "
            f"{meta.get('finish_reason')})",
        )
    token_lps = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    logits = meta.get("output_token_logits") or []
    return Result(
        prompt,
        True,
        output_ids=output_ids,
        logprobs=[float(entry[0]) for entry in token_lps],
        top=[[(int(e[1]), float(e[0])) for e in position or []] for position in tops],
        logits=[None if v is None else float(v) for v in logits],
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        kv_transfer=transfer,
        embedding_transfer=meta.get("embedding_transfer"),
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


def _get(client: httpx.Client, url: str) -> dict[str, Any]:
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


def flush(client: httpx.Client, urls: list[str]) -> list[str]:
    """POST /flush_cache to each server; problems, if any (a router may not have it)."""
    problems = []
    for url in urls:
        try:
            response = client.post(f"{url}/flush_cache", timeout=30)
            if response.status_code >= 400:
                problems.append(f"{url}/flush_cache answered {response.status_code}")
        except httpx.HTTPError as exc:
            problems.append(f"{url}/flush_cache: {type(exc).__name__}")
    return problems
