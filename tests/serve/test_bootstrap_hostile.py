"""Hostile input against prefill's bootstrap endpoint: every message gets a 4xx or is
accepted, never a 500; a message without the per-run secret is refused; a room cannot
be registered twice, after it closed, or with another KV layout."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdctl.serve.bootstrap import Rooms, bootstrap_app

SECRET = b"s3cret-for-tests"
AUTH = {"authorization": f"Bearer {SECRET.decode()}"}
LAYOUT = {"page_size": 16, "num_layers": 4, "head_dim": 32, "elem_bytes": 4}


def registration(room: int = 1, rank: int = 0, **changes: Any) -> dict[str, Any]:
    body = {
        "room": room,
        "decode_rank": rank,
        "decode_tp": 2,
        "decode_name": "decode-0",
        "transport": "dGNw",
        "num_tokens": 20,
        "page_size": 16,
        "mode": "staging",
        "kv_heads": 2,
        "head_dim": 32,
        "num_layers": 4,
        "elem_bytes": 4,
        "segment_bytes": 1 << 20,
        "pages": [3, 4],
        "kv_bases": [],
        "segments": [],
    }
    body.update(changes)
    return body


@pytest.fixture
def client() -> TestClient:
    rooms = Rooms(LAYOUT, expiry_s=30)
    return TestClient(bootstrap_app(rooms, SECRET, {"tp": 1, **LAYOUT}))


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = st.sampled_from(sorted(registration()))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(
        ["/bootstrap/register", "/bootstrap/segments", "/bootstrap/fail", "/bootstrap/fence"]
    ),
    body=JSON,
)
def test_arbitrary_json_never_breaks_the_endpoint(client: TestClient, path: str, body: Any) -> None:
    response = client.post(path, content=json.dumps(body), headers=AUTH)
    assert response.status_code < 500, response.text
    assert client.get("/bootstrap/info", headers=AUTH).status_code == 200


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(field=FIELDS, value=JSON)
def test_a_registration_with_one_wrong_field_is_refused_or_sane(
    client: TestClient, field: str, value: Any
) -> None:
    body = {**registration(room=7), field: value}
    response = client.post("/bootstrap/register", json=body, headers=AUTH)
    assert response.status_code in (200, 400, 409), response.text
    if response.status_code == 400:
        assert "malformed registration" in response.text or "incompatible" in response.text


def test_bytes_that_are_not_json_or_not_utf8(client: TestClient) -> None:
    for content in (b"{not json", b'{"room": "\xff\xfe"}', b"\x00" * 100, b"[" * 5000):
        response = client.post("/bootstrap/register", content=content, headers=AUTH)
        assert response.status_code == 400, (content[:20], response.text)


def test_the_secret_is_required_and_refusals_are_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    assert client.get("/bootstrap/info").status_code == 401
    wrong = {"authorization": "Bearer guess"}
    assert client.post("/bootstrap/register", json=registration(), headers=wrong).status_code == 401
    assert client.get("/bootstrap/room/1", headers=wrong).status_code == 401
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 3 and all("per-run secret" in m for m in refusals)
    assert not any(SECRET.decode() in r.getMessage() for r in caplog.records)


def test_oversized_messages_are_refused(client: TestClient) -> None:
    body = registration(pages=list(range(2_000_000)))
    response = client.post("/bootstrap/register", json=body, headers=AUTH)
    assert response.status_code == 413


def test_replays_other_layouts_and_closed_rooms(client: TestClient) -> None:
    assert client.post("/bootstrap/register", json=registration(), headers=AUTH).status_code == 200
    replay = client.post("/bootstrap/register", json=registration(), headers=AUTH)
    assert replay.status_code == 409 and "already registered room 1" in replay.text
    other = client.post("/bootstrap/register", json=registration(2, page_size=32), headers=AUTH)
    assert other.status_code == 400 and "page_size 32 differs from prefill's 16" in other.text
    rank = client.post("/bootstrap/register", json=registration(3, rank=2), headers=AUTH)
    assert rank.status_code == 400 and "decode_rank 2 is not below decode_tp" in rank.text
    closed = client.post("/bootstrap/fail", json={"room": 1, "reason": "test"}, headers=AUTH)
    assert closed.status_code == 200
    late = client.post("/bootstrap/register", json=registration(rank=1), headers=AUTH)
    assert late.status_code == 410 and "room 1 is closed" in late.text
    segments = {"room": 99, "decode_rank": 0, "segments": []}
    unknown = client.post("/bootstrap/segments", json=segments, headers=AUTH)
    assert unknown.status_code == 410


def test_rank_reports_have_no_route_here(client: TestClient) -> None:
    """Prefill's other ranks report over the TP group (`pd/reports.py`), not to HTTP."""
    report = {"room": 1, "rank": 1, "ok": True}
    assert client.post("/internal/sent", json=report, headers=AUTH).status_code == 404
    assert "/internal/sent" not in client.get("/openapi.json", headers=AUTH).json()["paths"]


def test_a_peer_address_no_url_can_carry_is_a_peer_error_not_a_crash() -> None:
    """A control character in a bootstrap host raised httpx.InvalidURL past the receive
    thread's handlers, which then never reported the room: its request waited forever."""
    from pdctl.serve.pd.client import Client, PeerCallError

    with pytest.raises(PeerCallError, match="is no address"):
        Client("http://\x12:1", "prefill bootstrap", 1.0).call("GET", "/bootstrap/info")
