"""The builtin router's vLLM flow (`--pd-flow vllm`), against scripted vLLM servers.

The router runs as a real process; prefill and decode are small HTTP servers on
loopback that answer as vLLM's do (prefill: `kv_transfer_params` in its answer) and
record what they were sent. Real vLLM behind the same router is tests/engines/
test_vllm_serving.py; here each way prefill can fail is scripted, so each is seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.serve.conftest import Server, app_in_thread, spawn_server, wait_healthy

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
          "remote_block_ids": [[1]], "remote_host": "127.0.0.1", "remote_port": 5600}  # fmt: skip


@dataclass
class Scripted:
    """A vLLM-like server: what it answers, and every body and request id it got."""

    role: str
    answer: Any = None  # prefill's JSON answer; None: the default
    status: int = 200
    seen: list[tuple[dict[str, Any], str | None]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.seen.append((body, request.headers.get("x-request-id")))
            if self.status != 200:
                return JSONResponse({"error": {"message": "EngineCore died"}}, self.status)
            if body.get("stream"):
                chunks = [b'data: {"choices":[{"token_ids":[7]}]}\n\n', b"data: [DONE]\n\n"]
                return StreamingResponse(iter(chunks), media_type="text/event-stream")
            if self.role == "prefill":
                answer = {"choices": [{"token_ids": [7]}], "kv_transfer_params": PARAMS}
                return JSONResponse(self.answer if self.answer is not None else answer)
            return JSONResponse({"choices": [{"token_ids": [7, 8, 9]}], "from": "decode"})

        return app


@pytest.fixture
def workers() -> Iterator[tuple[Scripted, Scripted, str, str]]:
    prefill, decode = Scripted("prefill"), Scripted("decode")
    with app_in_thread(prefill.app()) as prefill_url, app_in_thread(decode.app()) as decode_url:
        yield prefill, decode, prefill_url, decode_url


@pytest.fixture
def router(workers: tuple[Scripted, Scripted, str, str]) -> Iterator[Server]:
    _, _, prefill_url, decode_url = workers
    server = spawn_server("--pd-flow", "vllm", "--prefill", prefill_url, "--decode", decode_url,
                          "--request-timeout", "20", role="router")  # fmt: skip
    wait_healthy(server)  # the router's /health: both sides answered theirs
    yield server
    server.stop()


BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0}


def test_prefill_first_then_decode_with_its_params_under_one_request_id(
    workers: tuple[Scripted, Scripted, str, str], router: Server
) -> None:
    prefill, decode, _, _ = workers
    answer = httpx.post(f"{router.url}/v1/completions", json=BODY,
                        headers={"x-request-id": "rid-1"}, timeout=30)  # fmt: skip
    assert answer.status_code == 200 and answer.json()["from"] == "decode"
    (sent, prefill_id), (received, decode_id) = prefill.seen[0], decode.seen[0]
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert received["max_tokens"] == 16 and received["kv_transfer_params"] == PARAMS
    assert prefill_id == decode_id == "rid-1"


def test_a_request_without_an_id_gets_one_both_sides_share(
    workers: tuple[Scripted, Scripted, str, str], router: Server
) -> None:
    prefill, decode, _, _ = workers
    assert httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30).status_code == 200
    assert prefill.seen[0][1] and prefill.seen[0][1] == decode.seen[0][1]


def test_a_failing_prefill_answers_the_client_naming_it_and_decode_is_never_asked(
    workers: tuple[Scripted, Scripted, str, str], router: Server
) -> None:
    prefill, decode, prefill_url, _ = workers
    prefill.status = 500
    for stream in (False, True):  # a streamed request gets it as an HTTP error too
        answer = httpx.post(f"{router.url}/v1/completions", json={**BODY, "stream": stream},
                            timeout=30)  # fmt: skip
        assert answer.status_code == 502, answer.text
        message = answer.json()["error"]["message"]
        assert message.startswith(f"prefill {prefill_url} failed: 500") and "EngineCore" in message
    assert decode.seen == []


def test_a_prefill_without_kv_transfer_params_is_named(
    workers: tuple[Scripted, Scripted, str, str], router: Server
) -> None:
    prefill, decode, _, _ = workers
    prefill.answer = {"choices": [{"token_ids": [7]}]}  # a server with no KV connector
    answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30)
    assert answer.status_code == 502
    assert "answered without kv_transfer_params" in answer.json()["error"]["message"]
    assert decode.seen == []


def test_decodes_stream_passes_through_and_generate_is_refused(
    workers: tuple[Scripted, Scripted, str, str], router: Server
) -> None:
    _, decode, _, _ = workers
    streamed = httpx.post(f"{router.url}/v1/completions", json={**BODY, "stream": True}, timeout=30)
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert decode.seen[0][0]["stream"] is True
    refused = httpx.post(f"{router.url}/generate", json={"text": "hi"}, timeout=30)
    assert refused.status_code == 404 and "/v1/completions" in refused.json()["error"]["message"]
