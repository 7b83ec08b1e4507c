"""Each engine's dialect reads its real answers; the transfer proof judges real counters.

The answers and the metrics text below are what vLLM 0.32 and pdctl's servers sent
(trimmed to the fields read); the proof is judged as verify judges it, over HTTP
(httpx's mock transport standing in for decode's /metrics), so a recomputed prompt,
a request the engine never counted and an unreadable server each fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdctl.engines.dialect import AnswerError, CompletionsDialect, GenerateDialect
from pdctl.engines.proof import SGLangProof, VLLMProof, read_counters
from pdctl.verify import transfer
from pdctl.verify.client import Result
from pdctl.verify.transfer import ProofReader, judge
from pdctl.verify.workload import Prompt

VLLM_ANSWER = {
    "id": "cmpl-b8e044bd352a3231",
    "object": "text_completion",
    "choices": [
        {
            "index": 0,
            "text": "",
            "token_ids": [416, 238, 442],
            "finish_reason": "length",
            "logprobs": {
                "tokens": ["token_id:416", "token_id:238", "token_id:442"],
                "token_logprobs": [-0.684, -1.052, -1.108],
                "top_logprobs": [
                    {"token_id:502": -0.831, "token_id:416": -0.684, "token_id:339": -4.29},
                    {"token_id:238": -1.052, "token_id:349": -1.43},
                    {"token_id:442": -1.108, "token_id:502": -1.297},
                ],
            },
        }
    ],
    "usage": {"prompt_tokens": 10, "total_tokens": 13, "completion_tokens": 3,
              "prompt_tokens_details": {"cached_tokens": 32}},
    "kv_transfer_params": None,
}  # fmt: skip


def test_vllm_answers_read_in_token_ids_best_first() -> None:
    answer = CompletionsDialect().read(VLLM_ANSWER)
    assert answer.output_ids == [416, 238, 442]
    assert answer.logprobs == [-0.684, -1.052, -1.108]
    assert answer.top[0] == [(416, -0.684), (502, -0.831), (339, -4.29)]
    assert answer.cached_tokens == 32 and answer.finish_reason == "length"


def test_vllm_requests_ask_for_ids_and_logprobs_by_id() -> None:
    path, body = CompletionsDialect().request({"input_ids": [5, 6, 7]}, 16, 5)
    assert path == "/v1/completions"
    assert body == {"prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "logprobs": 5,
                    "return_tokens_as_token_ids": True}  # fmt: skip
    assert CompletionsDialect().request({"text": "hi"}, 1, 0)[1]["prompt"] == "hi"


@pytest.mark.parametrize(
    "broken",
    [
        {"choices": []},
        {"choices": [{"text": "no ids"}]},
        {"choices": [{"token_ids": [1], "logprobs": {"top_logprobs": [{"<s>": -1.0}]}}]},
        ["not", "an", "object"],
    ],
)
def test_a_vllm_answer_verify_cannot_read_is_an_error(broken: object) -> None:
    with pytest.raises(AnswerError):
        CompletionsDialect().read(broken)


def test_pdctl_and_sglang_answers_read_as_before() -> None:
    body = {
        "output_ids": [7, 8],
        "meta_info": {
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
            "output_top_logprobs": [[[-0.1, 7, None], [-2.0, 9, None]], [[-0.2, 8, None]]],
            "output_token_logits": [3.5, None],
            "cached_tokens": 16,
            "finish_reason": {"type": "length"},
        },
    }
    answer = GenerateDialect().read(body)
    assert answer.output_ids == [7, 8] and answer.top[0] == [(7, -0.1), (9, -2.0)]
    assert answer.logits == [3.5, None] and answer.cached_tokens == 16
    assert answer.finish_reason == "length"


def metrics(local: int, external: int, hit: int, finished: int) -> str:
    """decode's /metrics as vLLM 0.32 writes it (the lines the proof reads, and others)."""
    labels = 'engine="0",model_name="tiny"'
    by_source = f"vllm:prompt_tokens_by_source_total{{{labels},source="
    return "\n".join([
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.",
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        f'{by_source}"local_compute"}} {local}.0',
        f'{by_source}"local_cache_hit"}} {hit}.0',
        f'{by_source}"external_kv_transfer"}} {external}.0',
        f'vllm:prompt_tokens_by_source_created{{{labels},source="local_compute"}} 1.79e+09',
        f'vllm:request_success_total{{{labels},finished_reason="length"}} {finished}.0',
        f'vllm:request_success_total{{{labels},finished_reason="stop"}} 0.0',
        f"vllm:prompt_tokens_total{{{labels}}} {local + external + hit}.0",
    ])  # fmt: skip


def test_counters_sum_the_samples_whose_labels_match() -> None:
    counters = read_counters(metrics(3, 39, 32, 2), VLLMProof().counters)
    assert counters == {"local_compute": 3.0, "external": 39.0, "local_hit": 32.0, "finished": 2.0}


@pytest.mark.parametrize(
    ("delta", "settled", "problem"),
    [
        ({"local_compute": 0, "external": 39, "local_hit": 0, "finished": 1}, True, None),
        ({"local_compute": 0, "external": 7, "local_hit": 32, "finished": 1}, True, None),
        ({"local_compute": 39, "external": 0, "local_hit": 0, "finished": 1}, True, "computed 39"),
        ({"local_compute": 0, "external": 0, "local_hit": 0, "finished": 1}, True, "no prompt"),
        ({"local_compute": 0, "external": 0, "local_hit": 0, "finished": 0}, False, None),
    ],
)
def test_vllm_proof_judges_where_decode_got_the_prompt(
    delta: dict[str, float], settled: bool, problem: str | None
) -> None:
    verdict = VLLMProof().judge(delta, 1, 39)
    assert verdict.settled is settled
    assert (verdict.problem is None) if problem is None else (problem in (verdict.problem or ""))


def test_sglang_proof_wants_a_transfer_per_request_and_no_failure() -> None:
    proof = SGLangProof()
    ok = proof.judge({"sent": 2, "failed_prefill": 0, "failed_decode": 0}, 2, 100)
    assert ok.settled and ok.problem is None
    assert not proof.judge({"sent": 1, "failed_prefill": 0, "failed_decode": 0}, 2, 100).settled
    failed = proof.judge({"sent": 2, "failed_prefill": 0, "failed_decode": 1}, 2, 100)
    assert failed.problem is not None and "failed" in failed.problem


class Decode:
    """decode's /metrics, moving on by one snapshot each time it is read."""

    def __init__(self, pages: list[str]) -> None:
        self.pages: Iterator[str] = iter(pages)
        self.last = ""

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        self.last = next(self.pages, self.last)
        return httpx.Response(200, text=self.last)


def reader(decode: Decode) -> ProofReader:
    client = httpx.Client(transport=httpx.MockTransport(decode.handler))
    return ProofReader(VLLMProof(), {"prefill": ["http://p"], "decode": ["http://d"]}, client)


def answered(prompt_id: str = "p000") -> Result:
    return Result(Prompt(prompt_id, "sub-page", input_ids=list(range(1, 40))), True, [1, 2])


def test_a_transferred_request_is_marked_proven() -> None:
    decode = Decode([metrics(0, 0, 0, 0), metrics(0, 0, 0, 0), metrics(0, 39, 0, 1)])
    proof = reader(decode)
    before = proof.snapshot()
    result = answered()
    assert judge(proof, "serial", [result], before) is None  # counted at the second read
    assert result.transfer_proven == "decode's vllm:prompt_tokens_by_source_total"


def test_a_recomputed_prompt_fails_the_request_by_name() -> None:
    proof = reader(Decode([metrics(5, 0, 0, 0), metrics(44, 0, 0, 1)]))
    before = proof.snapshot()
    result = answered("p007")
    found = judge(proof, "serial", [result], before)
    assert found is not None and found.classification == "kv-not-transferred"
    assert found.request == "p007" and "requested is not effective" in found.message
    assert "decode computed 39 of 39 prompt tokens" in found.message
    assert result.transfer_proven is None


def test_a_request_the_engine_never_counts_is_unproven(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "SETTLE_S", 0.2)
    proof = reader(Decode([metrics(0, 0, 0, 0)]))
    found = judge(proof, "concurrent", [answered(), answered("p001")], proof.snapshot())
    assert found is not None and found.classification == "kv-unproven" and found.request == "-"


def test_unreadable_metrics_prove_nothing() -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(404)))
    proof = ProofReader(VLLMProof(), {"decode": ["http://d"]}, client)
    found = judge(proof, "serial", [answered()], "decode http://d/metrics answered 404")
    assert found is not None and found.classification == "kv-unproven"
    assert ProofReader(VLLMProof(), {"decode": []}, client).missing() is not None
