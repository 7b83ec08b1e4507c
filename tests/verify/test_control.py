"""The control before blame, against a scripted reference engine (httpx's mock transport).

The real servers are exercised end to end in test_verify.py (perturb-prefix-hit); here
each branch of the decision is driven on purpose: an engine that diverges by itself
on a prefix hit, one that does not, one that disagrees with the baseline even cold,
no reference at all, and a concurrent batch replayed.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdctl.verify.client import Result
from pdctl.verify.control import apply_controls
from pdctl.verify.diagnose import compare
from pdctl.verify.passes import Context, PassResult, Settings
from pdctl.verify.targets import Target
from pdctl.verify.workload import Prompt

PAGE = 16
PROMPT = Prompt("p001", "family", list(range(3, 3 + 2 * PAGE + 5)), family="f0")


def tokens(ids: list[int], count: int) -> list[int]:
    return [(sum(ids) + 7 * i) % 251 for i in range(count)]


class ScriptedEngine:
    """A colocated server with a page-aligned prefix cache; `numerics` shifts the first
    token of every prompt computed on a cache hit, `offset` every token of every answer."""

    def __init__(self, numerics: bool = False, offset: int = 0, caches: bool = True) -> None:
        self.numerics, self.offset, self.caches = numerics, offset, caches
        self.cache: set[tuple[int, ...]] = set()
        self.requests: list[tuple[int, int]] = []  # (prompt length, cached tokens)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/flush_cache":
            self.cache.clear()
            return httpx.Response(200, json={"success": True})
        body = json.loads(request.content)
        ids = body["input_ids"]
        hits = [len(p) for p in self.cache if len(p) < len(ids) and tuple(ids[: len(p)]) == p]
        cached = max(hits, default=0)
        answer = [t + self.offset for t in tokens(ids, body["sampling_params"]["max_new_tokens"])]
        if self.numerics and cached:
            answer[0] += 1
        if self.caches:
            self.cache.add(tuple(ids[: len(ids) // PAGE * PAGE]))
        self.requests.append((len(ids), cached))
        meta = {"cached_tokens": cached}
        return httpx.Response(200, json={"output_ids": answer, "meta_info": meta})


class WithReference(Target):
    def reference(self) -> str:
        return "http://reference"


def context(engine: ScriptedEngine | None, deterministic: bool = True) -> Context:
    settings = Settings(4, 2, True, False, True, 0.05, deterministic, 10.0)
    target = (WithReference if engine else Target)("http://router", [], [], None)
    client = httpx.Client(transport=httpx.MockTransport(engine or ScriptedEngine()))
    return Context(target, [PROMPT], settings, client)


def diverged(ctx: Context, run_pass: str = "prefix-hit", run_cached: int = 2 * PAGE) -> None:
    """A baseline from a cold cache, and a run whose first token differs with a clear margin."""
    base = Result(PROMPT, True, output_ids=tokens(PROMPT.input_ids or [], 4))
    changed = [base.output_ids[0] + 1, *base.output_ids[1:]]
    run = Result(PROMPT, True, output_ids=changed, cached_tokens=run_cached)
    ctx.passes = [PassResult("serial", [base]), PassResult(run_pass, [run])]
    found = compare(run_pass, base, run, near_tie=0.05)
    assert found is not None and found.classification == "unconfirmed"
    ctx.findings = [found]


@pytest.mark.parametrize("deterministic", [True, False])
def test_an_engine_that_diverges_on_its_own_is_engine_numerics(deterministic: bool) -> None:
    engine = ScriptedEngine(numerics=True)
    ctx = context(engine, deterministic)
    diverged(ctx)
    apply_controls(ctx)
    (finding,) = ctx.findings
    assert finding.classification == "engine-numerics"
    control = finding.evidence["control"]
    assert control["ran"] and control["run_state"] == "32 prompt tokens cached"
    assert control["output_ids"] == ctx.passes[1].results[0].output_ids
    assert control["baseline_state_output_ids"] == ctx.passes[0].results[0].output_ids
    assert "the same way" in finding.message and "not PD" in finding.message
    assert ("engine bug" in finding.message) is deterministic
    assert ("serving.deterministic: true" in finding.message) is not deterministic
    # cold first, then warmed with exactly the run's cached prefix, then the prompt hits it
    assert engine.requests == [(37, 0), (32, 0), (37, 32)]


def test_a_divergence_the_control_does_not_show_is_blamed_on_pd() -> None:
    ctx = context(ScriptedEngine())
    diverged(ctx)
    apply_controls(ctx)
    (finding,) = ctx.findings
    assert finding.classification == "divergence"
    assert "the KV or its transfer is wrong" in finding.message
    assert finding.evidence["control"]["output_ids"] == ctx.passes[0].results[0].output_ids


def test_a_reference_that_disagrees_even_cold_blames_nothing() -> None:
    ctx = context(ScriptedEngine(offset=1))
    diverged(ctx)
    apply_controls(ctx)
    (finding,) = ctx.findings
    assert finding.classification == "unconfirmed"
    assert "inconclusive" in finding.message and "nothing is blamed" in finding.message


def test_a_control_that_cannot_reach_the_runs_cache_state_blames_nothing() -> None:
    """A reference without a prefix cache cannot stand in for a prefix-hit run: its
    answer would agree with the baseline and blame PD falsely."""
    ctx = context(ScriptedEngine(caches=False))
    diverged(ctx)
    apply_controls(ctx)
    (finding,) = ctx.findings
    assert finding.classification == "unconfirmed"
    assert "found 0 cached tokens, the diverging run 32" in finding.message


def test_without_a_reference_nothing_is_blamed() -> None:
    ctx = context(None)
    diverged(ctx)
    apply_controls(ctx)
    (finding,) = ctx.findings
    assert finding.classification == "unconfirmed"
    assert finding.evidence["control"] == {
        "ran": False,
        "reason": "no topology to start a reference from (give the topology file)",
    }
    assert "no control could run" in finding.message


def test_a_concurrent_divergence_in_the_same_cache_state_replays_the_batch() -> None:
    engine = ScriptedEngine()
    ctx = context(engine)
    diverged(ctx, run_pass="concurrent", run_cached=0)
    apply_controls(ctx)
    (finding,) = ctx.findings
    assert finding.classification == "divergence"
    assert (
        finding.evidence["control"]["run_state"] == "the concurrent batch replayed at concurrency 2"
    )
    assert engine.requests == [(37, 0), (37, 0)]  # the baseline state, then the batch of one
