"""Disaggregated serving with real processes: prefill, decode and a router on loopback.

Every PD topology must give token ids identical to the colocated reference, for
serial, concurrent and prefix-hit requests, with every digest ok and every KV page
and ring region back afterwards.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.polling import wait_until
from tests.serve.conftest import Server, start_server
from tests.serve.pd_cluster import MODEL, PDCluster, pd_cluster, post

# Prompt lengths 20..131 cover 2 to 9 pages of 16 tokens; the last one is a
# prefix of the third plus a tail, so the prefix-hit run has something to reuse.
PROMPTS = [[(i * 7 + j * 13) % 500 + 1 for j in range(20 + 37 * i)] for i in range(4)]
HIT_PROMPT = PROMPTS[3] + [7, 8, 9, 10, 11]
SAMPLING = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def reference() -> Iterator[dict[str, list[int]]]:
    server = start_server(*MODEL, name="reference")
    try:
        outputs = {
            json.dumps(p): server.generate(input_ids=p, sampling_params=SAMPLING)["output_ids"]
            for p in [*PROMPTS, HIT_PROMPT]
        }
    finally:
        server.stop()
    yield outputs


def generate(cluster: PDCluster, prompt: list[int]) -> dict:
    return cluster.generate(input_ids=prompt, sampling_params=SAMPLING)


def check_topology(cluster: PDCluster, reference: dict[str, list[int]]) -> list[dict]:
    """Serial, concurrent and prefix-hit runs against the reference; pools back to full."""
    transfers = []
    for prompt in PROMPTS:  # serial
        result = generate(cluster, prompt)
        assert result["output_ids"] == reference[json.dumps(prompt)], f"prompt len {len(prompt)}"
        transfers.append(result["meta_info"]["kv_transfer"])
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate(cluster, p), PROMPTS))
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result["output_ids"] == reference[json.dumps(prompt)], "concurrent run differs"
        transfers.append(result["meta_info"]["kv_transfer"])
    hit = generate(cluster, HIT_PROMPT)  # prefill reuses PROMPTS[3]'s pages
    assert hit["output_ids"] == reference[json.dumps(HIT_PROMPT)]
    assert hit["meta_info"]["kv_transfer"]["cached_tokens"] >= 128
    assert hit["meta_info"]["cached_tokens"] >= 128
    transfers.append(hit["meta_info"]["kv_transfer"])
    for transfer in transfers:
        assert transfer["digest_ok"] is True
        assert transfer["bytes"] > 0
    cluster.pools_full()
    return transfers


# (backend, prefill TP, decode TP, staging) -> how the KV must have moved
TOPOLOGIES = [
    pytest.param("tcp", 1, 2, True, "staging", id="tcp-p1d2-staging"),
    pytest.param("tcp", 2, 1, True, "staging", id="tcp-p2d1-staging"),
    pytest.param("tcp", 1, 4, True, "staging", id="tcp-p1d4-staging"),
    # 4 KV heads over 8 decode ranks: each head lives on two ranks (GQA replication)
    pytest.param("tcp", 2, 8, True, "staging", id="tcp-p2d8-gqa-replicated"),
    pytest.param("tcp", 2, 2, True, "direct", id="tcp-p2d2-direct"),
    pytest.param("tcp", 1, 2, False, "direct", id="tcp-p1d2-nostaging"),
    # two writers to one decode rank: a doorbell ticket each, rank 1 rings its own
    pytest.param("tcp", 2, 1, False, "direct", id="tcp-p2d1-nostaging"),
    pytest.param("mooncake", 1, 2, True, "staging", id="mooncake-p1d2-staging"),
    pytest.param("mooncake", 2, 2, True, "direct", id="mooncake-p2d2-direct"),
    pytest.param("mooncake", 2, 1, False, "direct", id="mooncake-p2d1-nostaging"),
    pytest.param("nixl", 1, 2, True, "staging", id="nixl-p1d2-staging"),
    pytest.param("nixl", 1, 2, False, "direct", id="nixl-p1d2-nostaging"),
]


@pytest.mark.parametrize(("backend", "prefill_tp", "decode_tp", "staging", "path"), TOPOLOGIES)
def test_pd_tokens_match_colocated(
    reference: dict[str, list[int]],
    backend: str,
    prefill_tp: int,
    decode_tp: int,
    staging: bool,
    path: str,
) -> None:
    with pd_cluster(
        backend=backend, prefill_tp=prefill_tp, decode_tp=decode_tp, staging=staging
    ) as cluster:
        transfers = check_topology(cluster, reference)
    # pdctl's own transport tells a direct room's decode rank by its doorbell (same host)
    notice = "bell" if backend == "tcp" and path == "direct" else "message"
    for transfer in transfers:
        assert transfer["transport"] == backend
        assert transfer["staging"] is (path == "staging")
        assert transfer["notice"] == notice, transfer
        # pdctl's router adds prefill's side: the writes lie within the whole send
        assert 0 < transfer["write_ms"] <= transfer["send_ms"] + 0.01, transfer
        if path == "staging":
            assert transfer["segments"] >= 1
    # The prompt's whole KV reaches decode: 4 layers x K,V x 4 heads x 32 dims x 4 bytes
    # per token, over whole pages; with more decode ranks than heads, once per copy.
    copies = max(1, decode_tp // 4)
    assert transfers[0]["bytes"] == 2 * 16 * 4 * 2 * 4 * 32 * 4 * copies


def test_tiny_ring_wraps_and_segments(reference: dict[str, list[int]]) -> None:
    """A ring of two one-page regions: every request is cut into pages and the ring
    wraps many times, with concurrent rooms competing for it."""
    with pd_cluster(backend="tcp", pool_mb=1 / 16, segment_mb=1 / 32) as cluster:
        transfers = check_topology(cluster, reference)
        ring = cluster.decode[0].info()["staging_ring"]
    assert max(t["segments"] for t in transfers) == 9  # 131 tokens: one page per segment
    assert ring["watermark"][0] >= 10, ring  # the ring went round at least ten times


def test_sglang_router_gives_the_same_tokens(reference: dict[str, list[int]]) -> None:
    pytest.importorskip("sglang_router")
    with pd_cluster(backend="tcp", router="sglang-router") as cluster:
        check_topology(cluster, reference)


def test_router_streams_completions_and_reports(reference: dict[str, list[int]]) -> None:
    """Two prefill and two decode replicas behind the builtin router."""
    with pd_cluster(backend="tcp", decode_tp=1, replicas=(2, 2)) as cluster:
        prompt = PROMPTS[1]
        want = reference[json.dumps(prompt)]
        for _ in range(4):  # round-robin: each replica serves two
            assert generate(cluster, prompt)["output_ids"] == want
        served = [s.info()["stats"]["requests"] for s in cluster.prefill + cluster.decode]
        assert served == [2, 2, 2, 2]

        tokens = []
        body = {"input_ids": prompt, "sampling_params": SAMPLING, "stream": True}
        with httpx.stream("POST", f"{cluster.url}/generate", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    tokens = json.loads(line[6:])["output_ids"]
        assert tokens == want

        completion = post(
            cluster.url,
            "/v1/completions",
            {"model": "tiny", "prompt": [prompt, PROMPTS[0]], "max_tokens": 8, "temperature": 0},
        )
        assert [c["index"] for c in completion["choices"]] == [0, 1]
        assert completion["usage"]["completion_tokens"] == 16

        info = httpx.get(f"{cluster.url}/get_server_info", timeout=10).json()
        assert info["ready"] and len(info["prefill"]) == 2 and len(info["decode"]) == 2
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        assert "pdctl_router_requests_total 6" in metrics
        cluster.pools_full()


def router_workers(cluster: PDCluster) -> list[dict]:
    sides = httpx.get(f"{cluster.url}/get_server_info", timeout=5).json()
    return [*sides["prefill"], *sides["decode"]]


def test_router_admits_what_the_servers_admit(reference: dict[str, list[int]]) -> None:
    """Servers that admit two requests each, a burst of twelve through the router: the
    router learns the two, holds the rest, and the servers never see a third (each
    admitting its own first two of more could pick different ones and wait on each
    other until the bootstrap timeout)."""
    limit = ("--max-running-requests", "2")
    with pd_cluster(backend="tcp", prefill_extra=limit, decode_extra=limit) as cluster:
        learnt = lambda: all(w["capacity"] == 2 for w in router_workers(cluster))  # noqa: E731
        wait_until(learnt, 30, "the router to learn what its workers admit")
        seen: list[int] = []
        done = threading.Event()

        def watch() -> None:  # what each server and the router hold, while the burst runs
            while not done.is_set():
                for server in cluster.prefill + cluster.decode:
                    info = server.info()
                    seen.append(info["running_requests"] + info["waiting_requests"])
                seen.extend(w["in_flight"] for w in router_workers(cluster))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                results = list(pool.map(lambda p: generate(cluster, p), prompts))
        finally:
            done.set()
            watcher.join()
        for prompt, result in zip(prompts, results, strict=True):
            assert result["output_ids"] == reference[json.dumps(prompt)]
        assert seen and 0 < max(seen) <= 2, seen
        cluster.pools_full()


def test_router_is_unhealthy_without_workers(free_tcp_port: int) -> None:
    dead = f"http://127.0.0.1:{free_tcp_port}"
    router = start_router_unchecked(["--prefill", dead, "1", "--decode", dead])
    try:
        response = httpx.get(f"{router.url}/health", timeout=5)
        assert response.status_code == 503
        response = httpx.post(f"{router.url}/generate", json={"text": "hi"}, timeout=5)
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert f"no healthy prefill worker ({dead}" in message, message
        assert f"no healthy decode worker ({dead}" in message, message
    finally:
        router.stop()


def start_router_unchecked(targets: list[str]) -> Server:
    """A router whose workers are down: wait for its port, not for /health."""
    import subprocess
    import sys
    import tempfile

    from tests.serve.conftest import free_port

    port = free_port()
    argv = [sys.executable, "-m", "pdctl.serve", "--role", "router", "--port", str(port)]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by Server.stop)
    process = subprocess.Popen([*argv, *targets], stdout=log, stderr=log, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{server.url}/get_server_info", timeout=1)
            return server
        except httpx.HTTPError:
            time.sleep(0.1)
    server.stop()
    raise TimeoutError(server.log_tail())


@pytest.fixture
def free_tcp_port() -> int:
    from tests.serve.conftest import free_port

    return free_port()


# -- failures: each names the role and the reason, in time, and leaks nothing ----------


def pd_request(server: Server, cluster: PDCluster, room: int, **extra: object) -> httpx.Response:
    body = {
        "input_ids": PROMPTS[1],
        "sampling_params": SAMPLING,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.bootstrap_ports[0],
        "bootstrap_room": room,
        **extra,
    }
    return httpx.post(f"{server.url}/generate", json=body, timeout=60)


def error_of(response: httpx.Response) -> str:
    assert response.status_code >= 400, response.text
    return str(response.json()["error"]["message"])


@pytest.fixture(scope="module")
def fast_failing() -> Iterator[PDCluster]:
    with pd_cluster(backend="tcp", timeout=3.0, router="builtin") as cluster:
        yield cluster


def test_unknown_room_fails_on_decode(fast_failing: PDCluster) -> None:
    started = time.monotonic()
    message = error_of(pd_request(fast_failing.decode[0], fast_failing, room=111))
    elapsed = time.monotonic() - started
    assert message.startswith("decode:"), message
    assert "room 111" in message and "expired: no prefill request" in message, message
    assert elapsed < 3.0 + 3.0 + 2.0, elapsed
    fast_failing.pools_full()


def test_late_registration_fails_prefill_then_decode(fast_failing: PDCluster) -> None:
    started = time.monotonic()
    message = error_of(pd_request(fast_failing.prefill[0], fast_failing, room=222))
    assert time.monotonic() - started < 3.0 + 2.0
    assert message.startswith("prefill:") and "registered room 222 within 3 s" in message, message
    # decode comes too late: the room is closed, and decode says so at once
    started = time.monotonic()
    message = error_of(pd_request(fast_failing.decode[0], fast_failing, room=222))
    assert time.monotonic() - started < 2.0
    assert message.startswith("decode:") and "room 222 is closed" in message, message
    fast_failing.pools_full()


def test_duplicate_rooms_are_refused(fast_failing: PDCluster) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(pd_request, fast_failing.prefill[0], fast_failing, 333)
        decode = pool.submit(pd_request, fast_failing.decode[0], fast_failing, 333)
        assert prefill.result().status_code == 200, prefill.result().text
        assert decode.result().status_code == 200, decode.result().text
    again = pd_request(fast_failing.prefill[0], fast_failing, room=333)
    assert again.status_code in (409, 410) and "room 333" in error_of(again)
    message = error_of(pd_request(fast_failing.decode[0], fast_failing, room=333))
    assert message.startswith("decode:") and "room 333" in message, message
    fast_failing.pools_full()


def test_other_requests_carry_on(fast_failing: PDCluster, reference: dict[str, list[int]]) -> None:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        broken = pool.submit(pd_request, fast_failing.decode[0], fast_failing, 444)
        fine = [pool.submit(generate, fast_failing, p) for p in PROMPTS[:2]]
        for prompt, future in zip(PROMPTS[:2], fine, strict=True):
            assert future.result()["output_ids"] == reference[json.dumps(prompt)]
        assert broken.result().status_code >= 400
    fast_failing.pools_full()


def test_prefill_death_fails_decode_fast() -> None:
    with pd_cluster(backend="tcp", timeout=20.0, router=None) as cluster:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(pd_request, cluster.decode[0], cluster, 555)
            time.sleep(1.0)  # decode registered and waits for the KV
            os.killpg(cluster.prefill[0].process.pid, signal.SIGKILL)
            started = time.monotonic()
            message = error_of(waiting.result())
        assert time.monotonic() - started < 5.0  # not the 40 s of the timeouts
        assert message.startswith("decode:") and "did the prefill server die" in message, message
        info = cluster.decode[0].info()
        assert info["kv"]["free_pages"] == info["kv"]["total_pages"]
        assert info["staging_ring"]["empty"]


def test_decode_death_fails_prefill_fast() -> None:
    """Decode registered the room, then died: prefill's write fails and says where."""
    with pd_cluster(backend="tcp", timeout=20.0, router=None) as cluster:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            orphan = pool.submit(pd_request, cluster.decode[0], cluster, 666)
            time.sleep(1.0)  # decode registered room 666 with its transport address
            os.killpg(cluster.decode[0].process.pid, signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                orphan.result()
        started = time.monotonic()
        message = error_of(pd_request(cluster.prefill[0], cluster, 666))
        assert time.monotonic() - started < 5.0
        assert message.startswith("prefill:") and "decode" in message, message
        cluster.pools_full(servers=cluster.prefill)


def test_router_names_the_dead_side() -> None:
    with pd_cluster(backend="tcp", decode_tp=1) as cluster:
        os.killpg(cluster.decode[0].process.pid, signal.SIGKILL)
        cluster.decode[0].process.wait()
        time.sleep(1.5)  # the router's health check notices
        response = httpx.post(
            f"{cluster.url}/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": SAMPLING},
            timeout=30,
        )
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert f"no healthy decode worker ({cluster.decode[0].url}" in message, message
        assert httpx.get(f"{cluster.url}/health", timeout=5).status_code == 503


def test_corrupted_kv_is_caught_by_the_digest() -> None:
    """A byte flipped after prefill took its digests: decode refuses the KV and says where."""
    with pd_cluster(
        backend="tcp", prefill_env={"PDCTL_FAULTS": '[{"name": "corrupt-kv"}]'}
    ) as cluster:
        response = httpx.post(
            f"{cluster.url}/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": SAMPLING},
            timeout=30,
        )
        message = error_of(response)
        assert "decode" in message and "KV corruption in room" in message, message
        assert (
            "from prefill rank 0 to decode rank" in message
            and "(in the staging ring, segment 0)" in message
        )
        cluster.pools_full()


def test_corrupted_kv_of_a_direct_room_is_caught_by_the_digest() -> None:
    """corrupt-kv on a direct room: written by descriptors, a byte flipped after the
    digests; decode refuses the KV and names the direct write."""
    with pd_cluster(
        backend="tcp", decode_tp=1, staging=False,
        prefill_env={"PDCTL_FAULTS": '[{"name": "corrupt-kv"}]'},
    ) as cluster:  # fmt: skip
        response = httpx.post(
            f"{cluster.url}/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": SAMPLING},
            timeout=30,
        )
        message = error_of(response)
        assert "KV corruption in room" in message and "(direct write)" in message, message
        cluster.pools_full()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_without_doorbells_a_direct_room_is_told_by_message(
    reference: dict[str, list[int]], side: str
) -> None:
    """Decode offers no doorbell (--no-bells there), or prefill cannot ring the one
    offered (--no-bells on prefill: as a writer on another host): the notification
    carries the digests, and decode hears it while it also watches its doorbell."""
    off = ("--no-bells",)
    extra = {"prefill_extra": off} if side == "prefill" else {"decode_extra": off}
    with pd_cluster(prefill_tp=1, decode_tp=2, staging=False, **extra) as cluster:  # type: ignore[arg-type]
        for prompt in PROMPTS[:2]:
            result = generate(cluster, prompt)
            assert result["output_ids"] == reference[json.dumps(prompt)]
            transfer = result["meta_info"]["kv_transfer"]
            assert transfer["notice"] == "message" and transfer["digest_ok"] is True, transfer
        cluster.pools_full()


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_either_side_may_arrive_first(
    fast_failing: PDCluster, reference: dict[str, list[int]], first: str
) -> None:
    room = 777 if first == "prefill" else 778
    servers = {"prefill": fast_failing.prefill[0], "decode": fast_failing.decode[0]}
    second = "decode" if first == "prefill" else "prefill"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        early = pool.submit(pd_request, servers[first], fast_failing, room)
        time.sleep(1.0)  # well inside the 3 s bootstrap timeout
        late = pool.submit(pd_request, servers[second], fast_failing, room)
        responses = {first: early.result(), second: late.result()}
    assert responses["prefill"].status_code == 200, responses["prefill"].text
    assert responses["decode"].status_code == 200, responses["decode"].text
    assert responses["decode"].json()["output_ids"] == reference[json.dumps(PROMPTS[1])]
    fast_failing.pools_full()


def test_a_client_that_leaves_mid_transfer_gives_everything_back(
    fast_failing: PDCluster,
) -> None:
    """Decode waits for a room prefill never gets; the client gives up first."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{fast_failing.decode[0].url}/generate",
            json={
                "input_ids": PROMPTS[3],
                "sampling_params": SAMPLING,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": fast_failing.bootstrap_ports[0],
                "bootstrap_room": 888,
            },
            timeout=0.7,
        )
    fast_failing.pools_full(timeout=5.0)
