"""What the soak reports for one transport (`SoakRow`), and each part of it judged.

The answers against their references (failed, aborted, mismatched), the rates, the
resident memory of every process at the warm-up sample and at the end (with its trace
at every tenth of the load), how often each staging ring went round. Knows the load's
outcomes and the samples, nothing of how the run was started or the requests sent.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TypedDict

from pdctl.launch import rss
from pdctl.launch.soak_load import ABORTED, Outcome
from pdctl.records import RingState

ABORT_MARKS = (ABORTED, "abort-transfer")  # how an aborted request's answer reads
CORRUPTION_MARK = "KV corruption"  # a digest that did not match, as decode words it


class Mismatch(TypedDict):
    prompt: int  # index into the soak's distinct prompts
    expected: list[int] | None
    got: list[int] | None


class Answers(TypedDict):
    completed: int
    aborted: int  # by the abort-transfer fault, counted apart
    failed: int
    first_failure: str | None
    digest_mismatches: int
    mismatches: int
    first_mismatch: Mismatch | None


class Rates(TypedDict):
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    latency_ms_p50: float | None
    latency_ms_p99: float | None


class Memory(TypedDict):
    rss_warmup_request: int
    rss: list[rss.RssRow]
    rss_max_growth_pct: float | None
    rss_problems: list[str]


class SoakFigures(Answers, Rates, Memory):
    """One transport's soak as measured: its keys in the order the report gives them."""

    requests: int
    concurrency: int
    vocab: int
    pools_back: bool
    held: list[str]  # what a server still held at the end
    ring_wraps: dict[str, int]
    fences: dict[str, int]
    passed: bool


class SoakRow(SoakFigures):
    transport: str


class SoakReport(TypedDict):
    """`pdctl bench soak`'s report: the load, then a row per transport that ran."""

    topology: str
    file: str
    unique_prompts: int
    new_tokens: int
    pool_mb: float
    timeout_s: float
    rss_limit_pct: float
    abort_every: int | None
    decode_pool_tokens: int | None
    rows: list[SoakRow]
    skipped: dict[str, str]  # transport -> why it could not run here
    passed: bool


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def answers(
    reference: list[tuple[list[int] | None, str | None]],
    outcomes: list[Outcome],
    requests: int,
    aborts: bool = False,
) -> Answers:
    """Failures (reference, load, never sent) and answers that differ from the reference
    (only where the reference itself came back: a failed one is counted as failed).
    With `aborts`, a load request that ended aborted by the fault is counted apart."""
    failures = [e for _, e in reference if e is not None]
    errors = [o.error for o in outcomes if o.error is not None]
    aborted = [e for e in errors if aborts and any(mark in e for mark in ABORT_MARKS)]
    failures += [e for e in errors if e not in aborted]
    expected = [out for out, _ in reference]
    mismatched = [
        o for o in outcomes if o.output is not None and expected[o.prompt] not in (None, o.output)
    ]
    first = mismatched[0] if mismatched else None
    return {
        "completed": len(outcomes),
        "aborted": len(aborted),
        "failed": len(failures) + (requests - len(outcomes)),
        "first_failure": failures[0] if failures else None,
        "digest_mismatches": sum(CORRUPTION_MARK in e for e in failures),
        "mismatches": len(mismatched),
        "first_mismatch": None
        if first is None
        else {"prompt": first.prompt, "expected": expected[first.prompt], "got": first.output},
    }


def rates(outcomes: list[Outcome], wall: float, new_tokens: int) -> Rates:
    latencies = [o.latency_s * 1e3 for o in outcomes]
    return {
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(outcomes) / wall, 2),
        "tokens_per_s": round(len(outcomes) * new_tokens / wall, 1),
        "latency_ms_p50": round(statistics.median(latencies), 1) if latencies else None,
        "latency_ms_p99": round(percentile(latencies, 0.99), 1) if latencies else None,
    }


def memory(
    samples: Mapping[str, list[rss.ProcessRss]],
    trace: list[tuple[int, list[rss.ProcessRss]]],
    warmup: int,
    requests: int,
    limit_pct: float,
) -> Memory:
    """Growth between the warm-up sample and the end, per PID, with its trace."""
    rows, problems = rss.growth(samples.get("warm", []), samples.get("end", []), limit_pct)
    if "warm" not in samples or "end" not in samples:
        problems.append(f"RSS not sampled at requests {warmup} and {requests}")
    add_trace(rows, trace)
    return {
        "rss_warmup_request": warmup,
        "rss": rows,
        "rss_max_growth_pct": max((float(r["growth_pct"]) for r in rows), default=None),
        "rss_problems": problems,
    }


def add_trace(rows: list[rss.RssRow], trace: list[tuple[int, list[rss.ProcessRss]]]) -> None:
    """Each process's RSS (MiB) at every tenth of the load: a leak climbs all the way,
    a high-water mark (the largest batch so far) steps up and stays."""
    for row in rows:
        row["trace_mib"] = {
            done: round(p.rss_kib / 1024, 1)
            for done, found in trace
            for p in found
            if p.pid == row["pid"]
        }


def wraps(start: Mapping[str, RingState], end: Mapping[str, RingState]) -> dict[str, int]:
    """How many times each decode server's staging ring went round (its watermark's
    round) between the two states."""

    def round_of(ring: RingState | None) -> int:
        return ring.watermark[0] if ring is not None and ring.watermark else 0

    return {name: round_of(ring) - round_of(start.get(name)) for name, ring in end.items()}
