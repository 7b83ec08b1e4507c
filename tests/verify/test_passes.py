"""Single passes against a scripted router (httpx's mock transport): what they claim."""

from __future__ import annotations

import json

import httpx
import pytest

from pdctl.verify.client import Result
from pdctl.verify.passes import Context, PassResult, Settings, prefix_hit
from pdctl.verify.targets import Target
from pdctl.verify.workload import Prompt

FAMILY = [Prompt(f"p{i}", "family", [5] * 40 + [i], family="f0") for i in range(2)]


def router(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/flush_cache":
        return httpx.Response(200, json={"success": True})
    body = json.loads(request.content)
    count = body["sampling_params"]["max_new_tokens"]
    return httpx.Response(200, json={"output_ids": [7] * count, "meta_info": {"cached_tokens": 0}})


@pytest.mark.parametrize("served_before", [True, False])
def test_a_cache_miss_is_claimed_only_for_a_prefix_that_was_served(served_before: bool) -> None:
    """A prefix-hit answer with no cached token is a cache miss only when an earlier pass
    served that family whole; when every earlier request of it failed, prefill never
    had it to cache, and claiming otherwise would be false."""
    settings = Settings(4, 2, True, False, True, 0.05, True, 10.0)
    client = httpx.Client(transport=httpx.MockTransport(router))
    ctx = Context(Target("http://router", [], [], None), FAMILY, settings, client)
    earlier = [
        Result(p, served_before, output_ids=[7] * 4 if served_before else []) for p in FAMILY
    ]
    ctx.passes = [PassResult("serial", earlier), PassResult("prefix-hit")]
    prefix_hit(ctx, ctx.passes[-1])
    assert len(ctx.passes[-1].results) == 2 and all(r.ok for r in ctx.passes[-1].results)
    misses = [f for f in ctx.findings if f.classification == "cache-miss"]
    assert len(misses) == (2 if served_before else 0)
