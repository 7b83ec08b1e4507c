"""The verify passes: a table, one function each.

    serial         after flushing every cache: the baseline every other pass is compared with
    serial-repeat  the same again: a difference is the engine's nondeterminism, not PD
    concurrent     every prompt at once (up to the concurrency): batching must not matter
    prefix-hit     decode flushed, prefill keeps its radix cache: family prompts reuse pages
    reference      a colocated server of the same model, no KV transfer at all

Each function fills the PassResult it is given, request by request, so a pass cut
short by a dying role keeps what it got. Where the engine accounts for its transfers
(vLLM, SGLang), each PD request of a serial pass, and each concurrent pass as a
whole, is proven transferred from that accounting (`transfer.py`). Comparing and the
control before blame are the runner's (`runner.py`, `control.py`).
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypedDict

import httpx

from pdctl.engines.dialect import Dialect, GenerateDialect
from pdctl.errors import LaunchError
from pdctl.verify.client import Result, ResultJson, flush, generate
from pdctl.verify.diagnose import Finding
from pdctl.verify.targets import NoReference, Target
from pdctl.verify.transfer import Counters, ProofReader, Unreadable, judge
from pdctl.verify.workload import Prompt


@dataclass
class Settings:
    max_new_tokens: int
    concurrency: int
    prefix_hit: bool
    reference: bool
    serial_compare: bool
    near_tie: float
    deterministic: bool  # the topology asked for batch-invariant serving: numerics fail
    timeout: float
    compute_dtype: str | None = None  # margins are read in units of its last place
    engine: str = "embedded"  # whose dialect verify speaks and whose accounting it reads


class PassJson(TypedDict):
    """One pass as verify's JSON report gives it."""

    name: str
    skipped: str | None
    notes: list[str]
    timing: dict[str, float]  # wall_s, and the requests' p50_ms, p95_ms, max_ms
    requests: list[ResultJson]


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

    def to_json(self) -> PassJson:
        return {
            "name": self.name,
            "skipped": self.skipped,
            "notes": self.notes,
            "timing": self.timing(),
            "requests": [r.to_json() for r in self.results],
        }


class RoleDied(Exception):
    """A role of the target stopped while a pass ran (the message names it)."""


@dataclass
class Context:
    """What every pass works with; the runner owns it for one verify."""

    target: Target
    prompts: list[Prompt]
    settings: Settings
    client: httpx.Client
    passes: list[PassResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)  # a pass beside ends
    dialect: Dialect = field(default_factory=GenerateDialect)
    reader: ProofReader | None = None  # the engine's transfer accounting, where it has one

    def send(self, url: str, prompt: Prompt, max_new_tokens: int | None = None) -> Result:
        tokens = self.settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        return generate(self.client, url, prompt, tokens, self.settings.timeout, self.dialect)

    def flush(self, urls: list[str]) -> list[str]:
        return flush(self.client, urls, self.dialect.flush_path)

    def proven(self, pass_name: str, results: list[Result], before: Counters) -> None:
        """PD requests answered since `before`: proven transferred, or a finding."""
        if self.reader is not None:
            found = judge(self.reader, pass_name, results, before)
            if found is not None:
                self.findings.append(found)

    def counters(self) -> Counters:
        """The engine's transfer counters now (what could not be read, as text)."""
        if self.reader is None:
            return {}
        try:
            return self.reader.snapshot()
        except Unreadable as exc:
            return str(exc)

    def send_all(self, url: str, prompts: list[Prompt]) -> list[Result]:
        """Every prompt at once, up to the concurrency; results in prompt order."""
        with ThreadPoolExecutor(self.settings.concurrency) as pool:
            return list(pool.map(lambda p: self.send(url, p), prompts))

    def alive(self) -> None:
        try:
            self.target.check_alive()
        except LaunchError as exc:
            raise RoleDied(str(exc).splitlines()[0]) from None


PassFunction = Callable[[Context, PassResult], None]


@dataclass(frozen=True)
class Pass:
    name: str
    run: PassFunction
    compared: bool = True  # checked against the first pass
    repeat: bool = False  # a difference means the engine is not deterministic
    beside: bool = False  # runs beside the passes after the first, on a server of its own


def _serially(
    ctx: Context, result: PassResult, url: str, prompts: list[Prompt], *, beside: bool = False
) -> None:
    """One prompt after another; a pass beside the others (`beside`) leaves checking the
    topology's roles to them and ends early when they stop."""
    for prompt in prompts:
        if beside and ctx.stopped.is_set():
            result.skipped = "stopped: the passes beside it ended"
            return
        if beside:
            result.results.append(ctx.send(url, prompt))
            continue
        before = ctx.counters()
        result.results.append(ctx.send(url, prompt))
        ctx.alive()
        ctx.proven(result.name, result.results[-1:], before)


def serial(ctx: Context, result: PassResult) -> None:
    result.notes += ctx.flush(ctx.target.workers)
    _serially(ctx, result, ctx.target.router_url, ctx.prompts)


def concurrent(ctx: Context, result: PassResult) -> None:
    if ctx.settings.serial_compare:  # compared with a cold serial pass: start cold too
        result.notes += ctx.flush(ctx.target.workers)
    before = ctx.counters()
    result.results = ctx.send_all(ctx.target.router_url, ctx.prompts)
    ctx.alive()
    ctx.proven(result.name, result.results, before)


def prefix_hit(ctx: Context, result: PassResult) -> None:
    family = [p for p in ctx.prompts if p.family is not None]
    if not ctx.settings.prefix_hit:
        result.skipped = "disabled (verify.prefix_hit: false)"
        return
    if not family:
        result.skipped = "the workload has no prefix family"
        return
    result.notes += ctx.flush(ctx.target.decode_urls)  # prefill keeps its radix cache
    _serially(ctx, result, ctx.target.router_url, family)
    if len(ctx.target.prefill_urls) > 1:  # members of a family may go to different prefills
        result.notes.append("cache hits not claimed: several prefill servers share the family")
        return
    # a family's prefix is in prefill's cache once this pass served one of its prompts: the
    # next ones must reuse it (an earlier pass's may have been evicted by the passes since,
    # on a small KV pool, so they prove nothing)
    served: set[str | None] = set()
    for answer in result.results:
        if answer.ok and answer.cached_tokens <= 0 and answer.prompt.family in served:
            ctx.findings.append(
                Finding(
                    result.name,
                    answer.prompt.id,
                    "cache-miss",
                    "prefill reused no cached token for a prompt whose prefix it had just "
                    "served (cached_tokens = 0)",
                )
            )
        if answer.ok:
            served.add(answer.prompt.family)


def reference(ctx: Context, result: PassResult) -> None:
    """On the colocated reference, beside the PD passes after the first (a server of
    its own, on cores those leave idle: a serial PD request keeps one role busy at a
    time). It compares with the first pass only, done by then."""
    if not ctx.settings.reference:
        result.skipped = "not requested (--reference)"
        return
    try:
        url = ctx.target.reference()
    except NoReference as why:
        result.skipped = str(why)
        return
    _serially(ctx, result, url, ctx.prompts, beside=True)


PASSES: tuple[Pass, ...] = (
    Pass("serial", serial, compared=False),
    Pass("serial-repeat", serial, repeat=True),
    Pass("concurrent", concurrent),
    Pass("prefix-hit", prefix_hit),
    Pass("reference", reference, beside=True),
)
ONE_PASS: tuple[Pass, ...] = (Pass("concurrent", concurrent, compared=False),)
PASS_NAMES = tuple(p.name for p in PASSES)
