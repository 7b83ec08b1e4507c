"""The workload, fault specs and the diagnosis of mismatches, without servers."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdctl.errors import UsageError
from pdctl.verify.client import Result, generate
from pdctl.verify.diagnose import (
    MANTISSA_BITS,
    Finding,
    blocks,
    compare,
    failed_role,
    request_failure,
    ulp,
)
from pdctl.verify.session import parse_fault
from pdctl.verify.workload import Prompt, Shape, build

SHAPE = Shape(page=16, chunk=512, segment=256, ring=1024, max_context=4096, vocab=512)


def test_workload_is_deterministic_and_covers_every_path() -> None:
    first = build(SHAPE, 12, seed=7, max_new_tokens=16)
    assert first == build(SHAPE, 12, seed=7, max_new_tokens=16)
    assert first != build(SHAPE, 12, seed=8, max_new_tokens=16)
    kinds = {p.kind: p for p in first}
    assert set(kinds) == {
        "sub-page", "one-page", "chunked", "segmented", "ring-wrap", "family", "text",
    }  # fmt: skip
    assert kinds["sub-page"].length < 16 and kinds["one-page"].length == 16
    assert kinds["chunked"].length > SHAPE.chunk
    assert kinds["segmented"].length > SHAPE.segment
    assert kinds["ring-wrap"].length > SHAPE.ring
    families = [p for p in first if p.family == "f0"]
    assert len(families) >= 2
    prefix = 3 * SHAPE.page
    assert all(p.input_ids[:prefix] == families[0].input_ids[:prefix] for p in families)
    for prompt in first:
        assert (prompt.input_ids is None) != (prompt.text is None)
        assert all(3 <= t < SHAPE.vocab for t in prompt.input_ids or [])
        assert prompt.length + 16 < SHAPE.max_context


@given(st.text(max_size=60))
def test_fault_specs_parse_or_say_why(spec: str) -> None:
    try:
        fault = parse_fault(spec)
    except UsageError as exc:
        assert "is not KEY=VALUE" in exc.message
        return
    assert fault["name"] == spec.partition(":")[0].strip()


def test_fault_spec_values_are_typed() -> None:
    assert parse_fault("kill-role:role=decode,after=3") == {
        "name": "kill-role", "role": "decode", "after": 3,
    }  # fmt: skip
    with pytest.raises(UsageError, match="'every' is not KEY=VALUE"):
        parse_fault("corrupt-kv:every")


def result(ids: list[int], top: list[list[tuple[int, float]]] | None = None) -> Result:
    return Result(Prompt("p000", "one-page", [1, 2, 3]), True, output_ids=ids, top=top or [])


def test_a_clear_margin_is_a_divergence_with_evidence() -> None:
    top = [[(5, -0.1), (6, -3.0)]] * 4
    base = result([5, 5, 5, 5], top)
    other = result([5, 5, 9, 9], [[(5, -0.1), (6, -3.0)], [(5, -0.1), (6, -3.0)],
                                  [(9, -0.2), (5, -2.5)], [(9, -0.1), (1, -4.0)]])  # fmt: skip
    found = compare("concurrent", base, other, near_tie=0.05)
    assert found is not None and found.classification == "unconfirmed"  # until controlled
    assert found.position == 2
    assert found.evidence["expected"] == [5, 5, 5, 5] and found.evidence["got"] == [5, 5, 9, 9]
    assert found.evidence["baseline_top5"] == [[5, -0.1], [6, -3.0]]
    assert found.evidence["margin"] == pytest.approx(2.3)
    assert "token 2: expected 5, got 9" in found.message


def test_a_small_margin_is_a_near_tie_and_a_repeat_is_nondeterminism() -> None:
    top = [[(5, -0.69), (6, -0.70)]]
    base, other = result([5], top), result([6], [[(6, -0.69), (5, -0.70)]])
    assert compare("concurrent", base, other, near_tie=0.05).classification == "near-tie"
    assert compare("serial-repeat", base, other, 0.05, repeat=True).classification == (
        "nondeterministic"
    )
    assert compare("concurrent", base, result([5]), near_tie=0.05) is None


def test_request_failures_name_the_role_and_kv_corruption_its_place() -> None:
    failed = Result(Prompt("p001", "text", text="x"), False, status=502,
                    error="decode http://127.0.0.1:1 failed: 400 decode: KV corruption in room "
                    "12: layer 3 V from prefill rank 1 to decode rank 0 (after the scatter of "
                    "segment 2)")  # fmt: skip
    finding = request_failure("serial", failed)
    assert finding.classification == "kv-corruption"
    assert finding.evidence == {
        "layer": 3, "kv": "V", "prefill_rank": 1, "decode_rank": 0,
        "where": "after the scatter of segment 2", "error": failed.error,
    }  # fmt: skip
    timeout = Result(Prompt("p002", "text", text="x"), False, error="prefill http://x failed")
    assert request_failure("serial", timeout).evidence["role"] == "prefill"
    assert failed_role("no healthy decode worker (http://a: ConnectError)") == "decode"
    assert failed_role("no answer within 30 s") == "router"


def test_a_margin_of_a_few_bf16_ulps_at_the_logits_magnitude_is_numerics() -> None:
    # one bf16 step at |logit| in [8, 16) is 2**-4 = 0.0625: the H200 prefix-hit case
    top = [[(23315, -0.70), (17185, -0.7625)]]
    base = Result(Prompt("p", "family", [1]), True, output_ids=[23315], top=top, logits=[12.5])
    run = Result(Prompt("p", "family", [1]), True, output_ids=[17185],
                 top=[[(17185, -0.70), (23315, -0.7625)]], logits=[12.5])  # fmt: skip
    bf16 = compare("prefix-hit", base, run, near_tie=0.05, dtype="bfloat16")
    assert bf16 is not None and bf16.classification == "near-tie"
    assert bf16.evidence["near_tie_threshold"] == 4 * 0.0625
    fp32 = compare("prefix-hit", base, run, near_tie=0.05, dtype="float32")
    assert fp32 is not None and fp32.classification == "unconfirmed"  # 0.0625 is clear there
    unknown = compare("prefix-hit", base, run, near_tie=0.05, dtype=None)
    assert unknown is not None and unknown.classification == "unconfirmed"


@given(
    st.floats(min_value=1e-30, max_value=1e30, allow_nan=False) | st.floats(-1e30, -1e-30),
    st.sampled_from(["bfloat16", "float16", "float32"]),
)
def test_ulp_is_one_step_of_the_dtype_at_that_magnitude(value: float, dtype: str) -> None:
    bits = MANTISSA_BITS[dtype]
    unit = ulp(value, dtype)
    assert unit is not None
    assert abs(value) * 2.0**-bits >= unit > abs(value) * 2.0 ** -(bits + 1)
    assert ulp(value, "int8") is None and ulp(0.0, dtype) is None


def test_numerics_fail_only_under_deterministic_serving() -> None:
    for name in ("near-tie", "engine-numerics"):
        finding = Finding("concurrent", "p000", name, "x")
        assert blocks(finding, deterministic=True) and not blocks(finding, deterministic=False)
    for name in ("divergence", "unconfirmed", "kv-corruption", "request-failed"):
        assert blocks(Finding("concurrent", "p000", name, "x"), deterministic=False)


def test_an_answer_without_output_tokens_fails_its_request() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        meta = {"finish_reason": {"type": "abort"}, "kv_transfer": {"digest_ok": True}}
        return httpx.Response(200, json={"output_ids": [], "meta_info": meta})

    client = httpx.Client(transport=httpx.MockTransport(answer))
    prompt = Prompt("p000", "one-page", [5, 6, 7])
    result = generate(client, "http://router", prompt, max_new_tokens=4, timeout=5)
    assert not result.ok and result.status == 200
    assert result.error is not None and "carried no output tokens (4 asked for" in result.error
    finding = request_failure("serial", result)
    assert finding.classification == "request-failed"
