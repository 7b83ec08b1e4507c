"""Single passes against a scripted router (httpx's mock transport): what they claim."""

from __future__ import annotations

import json
import threading
import time
from unittest.mock import patch

import httpx
import pytest

from pdctl.errors import LaunchError
from pdctl.verify.client import Result
from pdctl.verify.passes import PASS_NAMES, Context, PassResult, Settings, prefix_hit
from pdctl.verify.runner import run_passes
from pdctl.verify.targets import Target
from pdctl.verify.workload import Prompt

FAMILY = [Prompt(f"p{i}", "family", [5] * 40 + [i], family="f0") for i in range(2)]


def router(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/flush_cache":
        return httpx.Response(200, json={"success": True})
    body = json.loads(request.content)
    count = body["sampling_params"]["max_new_tokens"]
    return httpx.Response(200, json={"output_ids": [7] * count, "meta_info": {"cached_tokens": 0}})


@pytest.mark.parametrize("first_served", [True, False])
def test_a_cache_miss_is_claimed_only_for_a_prefix_that_was_just_served(
    first_served: bool,
) -> None:
    """A prefix-hit answer with no cached token is a cache miss only when this pass had
    just served its family's prefix (a request of it answered); a prefix an earlier pass
    served may have been evicted since, and when the family's first request failed
    prefill never had it to cache: claiming a miss then would be false."""
    settings = Settings(4, 2, True, False, True, 0.05, True, 10.0)
    answered = iter([first_served, True])

    def scripted(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate" and not next(answered):
            return httpx.Response(400, json={"error": {"message": "refused"}})
        return router(request)

    client = httpx.Client(transport=httpx.MockTransport(scripted))
    ctx = Context(Target("http://router", [], [], None), FAMILY, settings, client)
    ctx.passes = [PassResult("serial", [Result(p, True, [7] * 4) for p in FAMILY])]
    ctx.passes.append(PassResult("prefix-hit"))
    prefix_hit(ctx, ctx.passes[-1])
    assert [r.ok for r in ctx.passes[-1].results] == [first_served, True]
    misses = [f for f in ctx.findings if f.classification == "cache-miss"]
    assert [m.request for m in misses] == (["p1"] if first_served else [])


class _Scripted(Target):
    """A router and a reference answered by `answer`; a role dies after `dies_after`
    router requests."""

    def __init__(self, reference_tokens: int = 7, dies_after: int | None = None) -> None:
        super().__init__("http://router", [], [], None)
        self.seen: list[str] = []
        self.reference_tokens, self.dies_after = reference_tokens, dies_after
        self.lock = threading.Lock()

    def reference(self) -> str:
        return "http://reference"

    def check_alive(self) -> None:
        routed = sum(1 for host in self.seen if host == "router")
        if self.dies_after is not None and routed >= self.dies_after:
            raise LaunchError("decode-0 (decode, pid 1) exited with code 1")

    def answer(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.seen.append(request.url.host)
        if request.url.path == "/flush_cache":
            return httpx.Response(200, json={"success": True})
        time.sleep(0.01)
        count = json.loads(request.content)["sampling_params"]["max_new_tokens"]
        token = self.reference_tokens if request.url.host == "reference" else 7
        return httpx.Response(
            200, json={"output_ids": [token] * count, "meta_info": {"cached_tokens": 0}}
        )


PROMPTS = [Prompt(f"q{i}", "plain", [3, 4, i]) for i in range(8)]


def _run(target: _Scripted) -> tuple[list[PassResult], list]:
    settings = Settings(4, 2, True, True, True, 0.05, True, 10.0)
    client = httpx.Client(transport=httpx.MockTransport(target.answer))
    with patch("pdctl.verify.runner.httpx.Client", return_value=client):
        return run_passes(target, PROMPTS, settings)


def test_the_reference_pass_runs_beside_the_pd_passes_and_is_checked_in_order() -> None:
    target = _Scripted()
    passes, findings = _run(target)
    assert [p.name for p in passes] == list(PASS_NAMES) and findings == []
    reference = passes[-1]
    assert len(reference.results) == len(PROMPTS) and all(r.ok for r in reference.results)
    hosts = target.seen
    first_reference = hosts.index("reference")
    # after the first pass (which it compares with), and before the PD passes ended
    assert hosts[:first_reference].count("router") >= len(PROMPTS)
    assert "router" in hosts[first_reference:]


def test_a_reference_that_differs_is_still_found() -> None:
    passes, findings = _run(_Scripted(reference_tokens=9))
    assert passes[-1].name == "reference"
    assert {f.pass_name for f in findings} == {"reference"}
    assert len(findings) == len(PROMPTS)


def test_a_role_that_dies_stops_the_pass_beside_and_is_reported() -> None:
    target = _Scripted(dies_after=len(PROMPTS) + 3)  # in serial-repeat
    passes, findings = _run(target)
    assert any(f.classification == "role-died" for f in findings), findings
    assert passes[-1].name == "serial-repeat"  # the reference joined nothing into the report
    before = len(target.seen)
    time.sleep(0.1)
    assert len(target.seen) == before  # nothing is still sending
