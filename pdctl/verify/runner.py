"""Run the verify passes against a target and collect findings.

A target is a topology pdctl launches (and tears down), a run `pdctl up` started
(never torn down), or any router URL that speaks the same API. The passes:
serial (after flushing caches), serial again (reproducibility), concurrent, prefix
hit (decode flushed, prefill keeps its radix cache; family prompts must reuse
cached tokens), and optionally a colocated reference of the same model. Every
pass after the first is compared with the first, token ids only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdctl.errors import LaunchError
from pdctl.verify.client import Result, flush, generate
from pdctl.verify.diagnose import Finding, compare, digest_problems, request_failure
from pdctl.verify.workload import Prompt

PASSES = ("serial", "serial-repeat", "concurrent", "prefix-hit", "reference")


@dataclass
class Settings:
    max_new_tokens: int
    concurrency: int
    prefix_hit: bool
    reference: bool
    serial_compare: bool
    near_tie: float
    strict_near_tie: bool  # a batch-invariant engine: a near-tie is a failure too
    timeout: float


@dataclass
class PassResult:
    name: str
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)

    def timing(self) -> dict[str, float]:
        latencies = [r.latency_ms for r in self.results]
        if not latencies:
            return {"wall_s": round(self.wall_s, 3)}
        ordered = sorted(latencies)
        return {
            "wall_s": round(self.wall_s, 3),
            "p50_ms": round(statistics.median(ordered), 2),
            "p95_ms": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 2),
            "max_ms": round(ordered[-1], 2),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "skipped": self.skipped,
            "notes": self.notes,
            "timing": self.timing(),
            "requests": [r.to_json() for r in self.results],
        }


@dataclass
class Target:
    """Where requests go, which servers to flush, and how to tell a role died."""

    mode: str  # launched | running | url
    router_url: str
    prefill_urls: list[str]
    decode_urls: list[str]
    check_alive: Callable[[], None] = lambda: None  # raises LaunchError naming the dead role
    start_reference: Callable[[], str] | None = None


class RoleDied(Exception):
    pass


def run_passes(
    target: Target, prompts: list[Prompt], settings: Settings
) -> tuple[list[PassResult], list[Finding]]:
    passes: list[PassResult] = []
    findings: list[Finding] = []
    client = httpx.Client(timeout=settings.timeout)

    def alive() -> None:
        try:
            target.check_alive()
        except LaunchError as exc:
            raise RoleDied(str(exc).splitlines()[0]) from None

    def serial(name: str, url: str, flush_all: bool = True) -> PassResult:
        result = PassResult(name)
        passes.append(result)  # partial results survive a role dying mid-pass
        if flush_all:
            result.notes += flush(client, target.prefill_urls + target.decode_urls)
        started = time.perf_counter()
        for prompt in prompts:
            result.results.append(
                generate(client, url, prompt, settings.max_new_tokens, settings.timeout)
            )
            alive()
        result.wall_s = time.perf_counter() - started
        return result

    def concurrent(name: str, chosen: list[Prompt]) -> PassResult:
        result = PassResult(name)
        passes.append(result)
        started = time.perf_counter()
        with ThreadPoolExecutor(settings.concurrency) as pool:
            result.results = list(
                pool.map(
                    lambda p: generate(
                        client, target.router_url, p, settings.max_new_tokens, settings.timeout
                    ),
                    chosen,
                )
            )
        result.wall_s = time.perf_counter() - started
        alive()
        return result

    def check(run: PassResult, baseline: PassResult | None, repeat: bool = False) -> None:
        by_id = {r.prompt.id: r for r in baseline.results} if baseline else {}
        for result in run.results:
            if not result.ok:
                findings.append(request_failure(run.name, result))
                continue
            problem = digest_problems(run.name, result)
            if problem is not None:
                findings.append(problem)
            base = by_id.get(result.prompt.id)
            if base is None or not base.ok:
                continue
            found = compare(run.name, base, result, settings.near_tie, repeat)
            if found is not None:
                findings.append(found)

    try:
        if not settings.serial_compare:
            check(concurrent("concurrent", prompts), None)
            return passes, findings
        first = serial("serial", target.router_url)
        check(first, None)
        again = serial("serial-repeat", target.router_url)
        check(again, first, repeat=True)
        flush(client, target.prefill_urls + target.decode_urls)
        check(concurrent("concurrent", prompts), first)
        family = [p for p in prompts if p.family is not None]
        if not settings.prefix_hit:
            passes.append(PassResult("prefix-hit", skipped="disabled (verify.prefix_hit: false)"))
        elif not family:
            passes.append(PassResult("prefix-hit", skipped="the workload has no prefix family"))
        else:
            hit = PassResult("prefix-hit")
            passes.append(hit)
            hit.notes += flush(client, target.decode_urls)  # prefill keeps its radix cache
            started = time.perf_counter()
            hit.results = [
                generate(client, target.router_url, p, settings.max_new_tokens, settings.timeout)
                for p in family
            ]
            hit.wall_s = time.perf_counter() - started
            alive()
            check(hit, first)
            for result in hit.results:
                if result.ok and result.cached_tokens <= 0:
                    findings.append(
                        Finding(
                            "prefix-hit",
                            result.prompt.id,
                            "cache-miss",
                            "prefill reused no cached token for a prompt whose prefix it "
                            "had just served (cached_tokens = 0)",
                        )
                    )
        if not settings.reference:
            passes.append(PassResult("reference", skipped="not requested (--reference)"))
        elif target.start_reference is None:
            passes.append(PassResult("reference", skipped="no topology to launch a reference from"))
        else:
            url = target.start_reference()
            check(serial("reference", url, flush_all=False), first)
    except RoleDied as died:
        current = passes[-1]
        current.wall_s = current.wall_s or sum(r.latency_ms for r in current.results) / 1e3
        baseline = passes[0] if passes[0] is not current else None
        check(current, baseline)  # what the pass got before the role died
        role = next((r for r in ("prefill", "decode", "router") if r in str(died)), "router")
        findings.append(
            Finding(
                passes[-1].name if passes else "serial",
                "-",
                "role-died",
                str(died),
                evidence={"role": role},
            )
        )
    finally:
        client.close()
    return passes, findings


def blocking(findings: list[Finding], settings: Settings) -> list[Finding]:
    """The findings that fail verification (near-ties only for batch-invariant engines)."""
    return [f for f in findings if f.classification != "near-tie" or settings.strict_near_tie]
