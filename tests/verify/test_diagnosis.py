"""The workload, fault specs and the diagnosis of mismatches, without servers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdctl.errors import UsageError
from pdctl.verify.client import Result
from pdctl.verify.diagnose import compare, failed_role, request_failure
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
    assert found is not None and found.classification == "divergence"
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
