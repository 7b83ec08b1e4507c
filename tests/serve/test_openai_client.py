"""Real clients against pdctl: the official OpenAI Python client (completions, chat plain
and streamed, models) on an embedded server and through the router of a CPU PD
topology, and SGLang's own serving benchmark client (`sglang.bench_serving`, three
backends) through that router with zero failed requests by its own count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serve.pd_cluster import PDCluster, pd_cluster

# make setup installs the client; a machine without it (a lent GPU host) skips the file
openai = pytest.importorskip("openai", reason="the OpenAI client is not installed here")

REPO = Path(__file__).resolve().parents[2]
MODEL_ID = "preset:tiny"  # the served model id: the preset's name
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def pd() -> Iterator[PDCluster]:
    with pd_cluster(decode_tp=1) as cluster:
        yield cluster


@pytest.fixture(params=["embedded", "router"])
def base_url(request: pytest.FixtureRequest) -> str:
    if request.param == "embedded":
        return str(request.getfixturevalue("tp1_server").url)
    return request.getfixturevalue("pd").url


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_list_and_retrieve(base_url: str) -> None:
    client = client_for(base_url)
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID] and models[0].object == "model"
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError, match=f"serves '{MODEL_ID}'"):
        client.models.retrieve("gpt-4")


def test_completions_with_the_fields_clients_send(base_url: str) -> None:
    client = client_for(base_url)
    neutral = dict(frequency_penalty=0, presence_penalty=0, n=1, best_of=1, user="u-1", seed=7)
    plain = client.completions.create(
        model=MODEL_ID, prompt="Hello", max_tokens=6, temperature=0, logprobs=2, **neutral
    )
    choice = plain.choices[0]
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 6
    assert plain.usage.prompt_tokens == 5 and len(choice.logprobs.token_logprobs) == 6
    chunks = list(
        client.completions.create(
            model=MODEL_ID, prompt="Hello", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, **neutral,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_plain_and_streamed(base_url: str) -> None:
    client = client_for(base_url)
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=CHAT, max_tokens=6, temperature=0, seed=1, logprobs=True,
        top_logprobs=2, frequency_penalty=0.0, presence_penalty=0.0, user="u-2",
    )  # fmt: skip
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert plain.object == "chat.completion" and plain.usage.completion_tokens == 6
    prompt = "<|system|>\nBe brief.\n<|user|>\nHello\n<|assistant|>\n"  # the plain template
    assert plain.usage.prompt_tokens == len(prompt.encode())
    assert len(choice.logprobs.content) == 6 and len(choice.logprobs.content[0].top_logprobs) == 2
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(
            model=MODEL_ID, messages=CHAT, max_tokens=2, top_logprobs=2
        )  # as OpenAI refuses it
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID, messages=CHAT, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_is_the_completion_of_its_rendered_prompt(base_url: str) -> None:
    """Greedy chat tokens are the greedy completion of the template's text, exactly."""
    prompt = "<|user|>\nHi\n<|assistant|>\n"
    body = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], **body}, timeout=60,
    ).json()  # fmt: skip
    completion = httpx.post(
        f"{base_url}/v1/completions", json={"prompt": prompt, **body}, timeout=60
    ).json()
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


def test_stop_strings_stop_and_are_trimmed(base_url: str) -> None:
    body = {"prompt": "Hello", "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    full = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    text = full["choices"][0]["text"]
    visible = [c for c in text[1:] if c != "\ufffd"]
    assert visible, f"the tiny model's greedy text has no character to stop on: {text!r}"
    stop = visible[0]
    cut = text.index(stop)
    stopped = httpx.post(
        f"{base_url}/v1/completions", json={**body, "stop": [stop, "never-seen"]}, timeout=60
    ).json()
    assert stopped["choices"][0] == {**stopped["choices"][0], "text": text[:cut],
                                     "finish_reason": "stop"}  # fmt: skip
    assert stopped["usage"]["completion_tokens"] < 24
    streamed = httpx.post(
        f"{base_url}/v1/completions", json={**body, "stop": stop, "stream": True}, timeout=60
    )
    pieces = [
        json.loads(line[6:])["choices"][0]["text"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(pieces) == text[:cut]


@pytest.mark.parametrize(
    ("path", "field", "value", "supported"),
    [
        ("/v1/completions", "frequency_penalty", 0.5, "only 0 is supported"),
        ("/v1/completions", "n", 2, "only 1 is supported"),
        ("/v1/completions", "logit_bias", {"5": 1.0}, "only none or {}"),
        ("/v1/chat/completions", "presence_penalty", -1.0, "only 0 is supported"),
        ("/v1/chat/completions", "tools", [{"type": "function"}], "only none or []"),
        ("/v1/chat/completions", "response_format", {"type": "json_object"}, 'only {"type"'),
    ],
)
def test_unsupported_values_are_refused_naming_the_field(
    base_url: str, path: str, field: str, value: object, supported: str
) -> None:
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    response = httpx.post(
        f"{base_url}{path}", json={**prompt, "max_tokens": 2, field: value}, timeout=30
    )
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"{field}: {supported}" in message and "got" in message


def test_generate_accepts_neutral_penalties_and_refuses_others(base_url: str) -> None:
    sampling = {"temperature": 0, "max_new_tokens": 2, "repetition_penalty": 1.0, "n": 1}
    ok = httpx.post(
        f"{base_url}/generate", json={"text": "x", "sampling_params": sampling}, timeout=30
    )
    assert ok.status_code == 200, ok.text
    sampling["repetition_penalty"] = 1.2
    refused = httpx.post(
        f"{base_url}/generate", json={"text": "x", "sampling_params": sampling}, timeout=30
    )
    assert refused.status_code == 400
    assert "sampling_params.repetition_penalty: only 1 is supported" in refused.text


def byte_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer for the bench's token counts: printable ASCII as the
    preset's byte ids (the servers tokenize the text themselves)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(c): c for c in range(32, 127)} | {"[UNK]": 0}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("backend", ["sglang-oai", "sglang-oai-chat", "sglang"])
def test_sglang_bench_serving_through_the_router(
    pd: PDCluster, backend: str, tmp_path: Path
) -> None:
    result = tmp_path / "result.jsonl"
    argv = [
        sys.executable, str(REPO / "tests/serve/sglang_bench.py"), "--backend", backend,
        "--base-url", pd.url, "--model", MODEL_ID, "--tokenizer", str(byte_tokenizer(tmp_path)),
        "--dataset-name", "random-ids", "--num-prompts", "8", "--random-input-len", "32",
        "--random-output-len", "6", "--random-range-ratio", "1", "--seed", "1",
        "--output-file", str(result), "--output-details", "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(result.read_text().splitlines()[-1])
    errors = [e for e in report.get("errors", []) if e]
    assert report["completed"] == 8 and errors == [], errors[:2]
    assert report["total_output_tokens"] == 8 * 6
