"""The HTTP API against real server processes on loopback."""

from __future__ import annotations

import json
import time

import httpx
import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_generate_single_batch_and_logprobs(tp1_server) -> None:
    one = tp1_server.generate(
        input_ids=[1, 2, 3, 4], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
    )
    meta = one["meta_info"]
    assert (
        len(one["output_ids"]) == 6
        and meta["completion_tokens"] == 6
        and meta["prompt_tokens"] == 4
    )
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [row[1] for row in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(len(top) == 3 and top[0][0] >= top[1][0] for top in meta["output_top_logprobs"])
    batch = tp1_server.generate(input_ids=[[1, 2, 3, 4], [9, 9]], sampling_params=GREEDY)
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    texts = tp1_server.generate(text=["Hello", "world"], sampling_params=GREEDY)
    assert [r["meta_info"]["prompt_tokens"] for r in texts] == [5, 5]


def test_streaming_generate_ends_with_done(tp1_server) -> None:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": GREEDY, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{tp1_server.url}/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    last = json.loads(chunks[-2])
    expected = tp1_server.generate(input_ids=[1, 2, 3, 4], sampling_params=GREEDY)
    assert (
        last["output_ids"] == expected["output_ids"]
        and last["meta_info"]["finish_reason"]["type"] == "length"
    )


def test_openai_client_completions_and_stream(tp1_server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{tp1_server.url}/v1", api_key="unused")
    completion = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("length", "stop") and completion.usage.prompt_tokens == 5
    assert len(choice.logprobs.token_logprobs) == completion.usage.completion_tokens
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Hello", max_tokens=5, temperature=0, stream=True
        )
    )
    assert streamed == choice.text


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (
            {"text": "x", "sampling_params": {"max_new_token": 3}},
            400,
            "sampling_params.max_new_token",
        ),
        ({"text": "x", "input_ids": [1]}, 400, "exactly one of text and input_ids"),
        ({"input_ids": []}, 400, "the prompt is empty"),
        ({"input_ids": [1, 600]}, 400, "token 600 at input_ids[1] is outside the vocabulary"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}},
            400,
            "exceeds the context",
        ),
        (
            {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
            400,
            "sampling_params.temperature",
        ),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, 400, "top_k must be -1"),
        ({"input_ids": "abc"}, 400, "input_ids"),
    ],
)
def test_bad_generate_requests_name_the_field(tp1_server, body, status, needle) -> None:
    response = httpx.post(f"{tp1_server.url}/generate", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]


def test_malformed_and_oversized_bodies_then_still_serving(tp1_server) -> None:
    bad_json = httpx.post(
        f"{tp1_server.url}/generate",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad_json.status_code == 400
    not_utf8 = httpx.post(
        f"{tp1_server.url}/generate",
        content=b'{"text": "\xff\xfe"}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert not_utf8.status_code == 400
    huge = httpx.post(
        f"{tp1_server.url}/generate",
        content=b"x" * (17 << 20),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert huge.status_code == 413
    assert httpx.get(f"{tp1_server.url}/health", timeout=10).status_code == 200
    assert tp1_server.generate(input_ids=[1, 2], sampling_params=GREEDY)["output_ids"]


def test_client_disconnect_aborts_and_frees_pages(tp1_server) -> None:
    body = {
        "input_ids": list(range(1, 200)),
        "sampling_params": {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", f"{tp1_server.url}/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first token arrived; now hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = tp1_server.info()
        if info["running_requests"] == 0 and info["waiting_requests"] == 0:
            break
        time.sleep(0.2)
    assert info["running_requests"] == 0 and info["stats"]["aborted"] >= 1
    httpx.post(f"{tp1_server.url}/flush_cache", timeout=30)
    kv = tp1_server.info()["kv"]
    assert kv["free_pages"] == kv["total_pages"]


def test_service_endpoints(tp1_server) -> None:
    assert httpx.get(f"{tp1_server.url}/health_generate", timeout=60).status_code == 200
    info = httpx.get(f"{tp1_server.url}/get_model_info", timeout=10).json()
    assert info["model_path"] == "preset:tiny" and info["is_generation"]
    server = tp1_server.info()
    assert server["role"] == "colocated" and server["tp"] == 1 and server["kv"]["page_size"] == 16
    graphs = server["cuda_graphs"]
    assert graphs["enabled"] is False and graphs["reason"] == "not CUDA (cpu)"
    metrics = httpx.get(f"{tp1_server.url}/metrics", timeout=10).text
    assert "pdctl_generated_tokens_total" in metrics and "pdctl_kv_free_pages" in metrics
    flushed = httpx.post(f"{tp1_server.url}/flush_cache", timeout=30).json()
    assert flushed["success"] is True


def test_tp_sizes_serve_identical_tokens(server_factory) -> None:
    prompts = [[1, 2, 3], list(range(10, 90)), list(range(300, 500)), [7] * 33]
    body = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
    }
    outputs = {}
    for tp in (1, 2, 4):
        server = server_factory("--kv-pool-tokens", "4096", tp=tp, name=f"tp{tp}")
        outputs[tp] = [r["output_ids"] for r in server.generate(**body)]
        server.stop()
    assert outputs[1] == outputs[2] == outputs[4]
