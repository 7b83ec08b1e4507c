"""Hostile request bodies against a real server: a 4xx each, never a 5xx, and the
server keeps serving the same tokens afterwards (no request touches another's KV)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GREEDY = {"temperature": 0, "max_new_tokens": 4}
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=25,
)
FIELDS = st.sampled_from(
    [
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "return_logprob",
        "top_logprobs_num",
        "rid",
        "bootstrap_room",
        "prompt",
        "max_tokens",
        "temperature",
        "n",
        "logprobs",
    ]
)


def reference(url: str) -> list[int]:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}
    return httpx.post(f"{url}/generate", json=body, timeout=60).json()["output_ids"]


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/generate", "/v1/completions"]),
    body=st.dictionaries(FIELDS, JSON, max_size=4) | JSON,
)
def test_arbitrary_bodies_get_4xx_or_an_answer(tp1_server: Any, path: str, body: Any) -> None:
    if (
        isinstance(body, dict)
        and "sampling_params" in body
        and isinstance(body["sampling_params"], dict)
    ):
        body["sampling_params"].setdefault("max_new_tokens", 2)  # keep real work small
    if isinstance(body, dict):
        body.setdefault("max_tokens", 2)
    response = httpx.post(
        f"{tp1_server.url}{path}",
        content=json.dumps(body),
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert response.status_code < 500, response.text


def test_deep_huge_and_binary_bodies_then_the_same_tokens(tp1_server: Any) -> None:
    before = reference(tp1_server.url)
    cases = [
        b"[" * 50_000,
        b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b"\xff\xfe\x00\x01" * 100,
        json.dumps({"input_ids": [1] * 200_000, "sampling_params": GREEDY}).encode(),
        json.dumps({"input_ids": [-1, 2]}).encode(),
        json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**12}}).encode(),
    ]
    for content in cases:
        response = httpx.post(
            f"{tp1_server.url}/generate",
            content=content,
            timeout=60,
            headers={"content-type": "application/json"},
        )
        assert 400 <= response.status_code < 500, (content[:40], response.text[:200])
    assert reference(tp1_server.url) == before
    info = httpx.get(f"{tp1_server.url}/get_server_info", timeout=30).json()
    assert info["running_requests"] == 0 and info["waiting_requests"] == 0


def test_a_body_of_undeclared_length_is_refused_unread(tp1_server: Any) -> None:
    def endless() -> Any:  # chunked: the server would have to read it to know its size
        yield b'{"input_ids": ['
        for _ in range(3):
            yield b"1, " * 1000

    response = httpx.post(
        f"{tp1_server.url}/generate",
        content=endless(),
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 411, response.text
    assert "Content-Length" in response.json()["error"]["message"]
    assert reference(tp1_server.url)  # still serving
