"""`pdctl bench soak`: many requests through a PD topology, per transport, nothing lost.

For each transport the topology is launched (real processes on loopback: prefill,
decode with its TP ranks, router) with a staging ring small enough that the soak
wraps it many times. A set of distinct prompts of mixed lengths, within the
vocabulary and context the servers report (`/get_model_info`), is sent once,
serially, at temperature 0: the reference, the first PD answer of each prompt. Then
`requests` requests drawn from that set run `concurrency` at a time
(`soak_load.py`), each bounded by a timeout, and every answer is compared token by
token with its prompt's reference (a request that fails, or one whose tokens
differ, counts; CI proves both are caught, with injected faults).

With `abort_every` N, the servers inject `abort-transfer`: past the reference pass,
decode aborts one room in N while prefill's write to it is in flight, and that write
lands after decode gave up (`serve/faults.py`). Those requests end aborted, as
their client would see them; every other request must still be token-exact, no
digest may mismatch (a late write landing in memory someone else now holds), and the
pools must come back: what `abort-transfer` proves is that freed memory is fenced.

The resident memory of every process of the run (`rss.py`: each PID of each
server's group, TP ranks and the router included) is sampled when the `warmup`-th
request completed and again when the last did; growth of `RSS_LIMIT_PCT` or more in
any of them fails the soak, as do a failure, a mismatch, or a KV pool or staging
ring not fully back at the end (`Run.pools_back`). The run is torn down whatever
happens (`Run.serving`), Ctrl-C included.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import httpx

from pdctl.launch import rss
from pdctl.launch.bench import refuse_other_engines, variant
from pdctl.launch.launcher import make_run
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.requirements import unmet
from pdctl.launch.run import Run
from pdctl.launch.soak_load import Load, generate
from pdctl.launch.soak_report import (
    SoakFigures,
    SoakReport,
    SoakRow,
    answers,
    memory,
    rates,
    wraps,
)
from pdctl.records import ServerInfo
from pdctl.topology import load_file

RSS_LIMIT_PCT = 3.0
LENGTHS = (3, 15, 16, 17, 40, 64, 100, 150, 250, 400)  # around page and segment edges
# With aborts, decode's KV pool (tokens) unless given: a few of the longest prompts
# fit, so under load a page freed is handed out again at once (first in, first out
# reuse alone would hide a late write in a page nobody holds). Prefill keeps the
# topology's: with both pools page-bound, prefill can fill with rooms decode has no
# pages for while decode fills with rooms prefill has not computed, each side waiting
# on the other until the bootstrap timeout (measured: 122 of 2,200 requests, no abort)
ABORT_POOL_TOKENS = 2048


class Fault(TypedDict):
    """A fault as a topology's `faults` lists it."""

    name: str
    every: int
    after: int


class Changes(TypedDict, total=False):
    """What the soak changes of the topology file (merged in by `bench.variant`)."""

    faults: list[Fault]
    roles: dict[str, dict[str, int]]


def prompts_for(count: int, seed: int, vocab: int, max_len: int) -> list[list[int]]:
    """`count` random prompts of ids in [3, vocab), none longer than `max_len`."""
    rng = random.Random(seed)
    lengths = [min(rng.choice(LENGTHS), max_len) for _ in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def served_shape(run: Run) -> tuple[int, int]:
    """(vocabulary, context) the run's servers report: the smallest of each."""
    vocab, context = [], []
    for state in run.states:
        if state.plan.role not in ("prefill", "decode"):
            continue
        try:
            info = httpx.get(f"{state.url}/get_model_info", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(info.get("vocab_size"), int):
            vocab.append(info["vocab_size"])
        if isinstance(info.get("max_context"), int):
            context.append(info["max_context"])
    return min(vocab, default=500), min(context, default=512)


def fences(run: Run) -> dict[str, int]:
    """Rooms the servers fenced (held for their writers) and how each went back, summed
    over the run's servers (`/get_server_info` `fence`)."""
    total = {"released": 0, "writer_gone": 0, "unconfirmed": 0}
    for state in run.states:
        if state.plan.role not in ("prefill", "decode"):
            continue
        try:
            info = ServerInfo.from_json(
                httpx.get(f"{state.url}/get_server_info", timeout=10).json()
            )
        except (httpx.HTTPError, ValueError):
            continue
        for key in total:
            total[key] += getattr(info.fence, key, 0) if info.fence is not None else 0
    return total


def _groups(run: Run) -> dict[str, int]:
    return {s.plan.name: s.spawned.pid for s in run.states if s.spawned is not None}


@dataclass(frozen=True)
class Soak:
    """One transport's soak: the load, and the bounds its figures are judged by."""

    requests: int
    concurrency: int
    unique: int  # distinct prompts
    new_tokens: int
    warmup: int  # the request whose completion takes the first RSS sample
    timeout: float  # per request, seconds
    seed: int
    rss_limit_pct: float
    aborts: bool = False  # decode aborts rooms mid-transfer (`abort-transfer`)


class Samples:
    """RSS of the run's processes as the load completes: at the warm-up request, at
    every tenth of the load (a leak climbs, a high-water mark steps and stays), at the
    end."""

    def __init__(self, run: Run, soak: Soak, progress: Callable[[str], None]) -> None:
        self.run, self.soak, self.progress = run, soak, progress
        self.taken: dict[str, list[rss.ProcessRss]] = {}  # "warm", "end"
        self.trace: list[tuple[int, list[rss.ProcessRss]]] = []

    def on_done(self, done: int) -> None:
        requests, warmup = self.soak.requests, self.soak.warmup
        tenth = max(1, requests // 10)
        if done == warmup:
            self.taken["warm"] = rss.sample(_groups(self.run))
            self.progress(f"  {done}/{requests} done: RSS sampled (warm-up)")
        elif done % tenth == 0 and done < requests:
            self.progress(f"  {done}/{requests} done")
        if done % tenth == 0 or done in (warmup, requests):
            self.trace.append((done, rss.sample(_groups(self.run))))
        if done == requests:
            self.taken["end"] = self.trace[-1][1]


def soak_one(run: Run, soak: Soak, progress: Callable[[str], None]) -> SoakFigures:
    url = run.router_url
    vocab, context = served_shape(run)
    prompts = prompts_for(soak.unique, soak.seed, vocab, max(1, context - soak.new_tokens))
    with httpx.Client() as client:
        reference = [generate(client, url, p, soak.new_tokens, soak.timeout) for p in prompts]
    _, _, rings_start = run.pools_back()
    order = random.Random(soak.seed).choices(range(len(prompts)), k=soak.requests)
    samples = Samples(run, soak, progress)
    progress(
        f"  {soak.requests} requests, {soak.concurrency} in flight, {soak.unique} distinct prompts"
    )
    load = Load(
        url,
        prompts,
        order,
        concurrency=soak.concurrency,
        new_tokens=soak.new_tokens,
        timeout=soak.timeout,
        on_done=samples.on_done,
    )
    started = time.perf_counter()
    try:  # a Ctrl-C while the workers start stops them too (else they send on, forever)
        load.start()
        load.wait(run.check_exits)
    except BaseException:  # Ctrl-C, a dead server: the run's owner stops the servers now,
        load.close(grace=0)  # which ends the requests in flight; no wait for them here
        raise
    load.close(grace=soak.timeout)
    wall = time.perf_counter() - started
    if load.callback_error is not None:
        raise load.callback_error
    found = answers(reference, load.outcomes, soak.requests, soak.aborts)
    pools_ok, held, rings_end = run.pools_back()
    used = memory(samples.taken, samples.trace, soak.warmup, soak.requests, soak.rss_limit_pct)
    clean = found["failed"] == 0 and found["mismatches"] == 0 and pools_ok
    return {
        "requests": soak.requests,
        "concurrency": soak.concurrency,
        "vocab": vocab,
        **found,
        **rates(load.outcomes, wall, soak.new_tokens),
        "pools_back": pools_ok,
        "held": held,
        "ring_wraps": wraps(rings_start, rings_end),
        "fences": fences(run),
        **used,
        "passed": clean and not used["rss_problems"] and (not soak.aborts or found["aborted"] > 0),
    }


def bench_soak(
    topology: Path,
    *,
    backends: tuple[str, ...] = ("tcp", "mooncake", "nixl"),
    requests: int = 10000,
    concurrency: int = 64,
    unique: int = 48,
    new_tokens: int = 8,
    pool_mb: float = 0.5,
    warmup: int | None = None,
    timeout: float = 120.0,
    rss_limit_pct: float = RSS_LIMIT_PCT,
    seed: int = 0,
    abort_every: int | None = None,
    decode_pool_tokens: int | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> SoakReport:
    """The soak of each transport in turn; `warmup` defaults to a fifth of `requests`
    (the 2,000th of 10,000). `abort_every` N: decode aborts one room in N mid-transfer
    (`abort-transfer`, past the `unique` rooms of the reference pass), with a decode KV
    pool of `decode_pool_tokens` (default ABORT_POOL_TOKENS with aborts, else the
    topology's)."""
    base = load_file(topology).topology
    refuse_other_engines(base, "bench soak", "pdctl verify checks a vLLM or SGLang topology")
    warm = min(requests, warmup if warmup is not None else max(1, requests // 5))
    if decode_pool_tokens is None and abort_every is not None:
        decode_pool_tokens = ABORT_POOL_TOKENS
    changes: Changes = {"faults": abort_faults(abort_every, unique)}
    if decode_pool_tokens is not None:
        changes["roles"] = {"decode": {"kv_pool_tokens": decode_pool_tokens}}
    aborts = abort_every is not None
    soak = Soak(
        requests, concurrency, unique, new_tokens, warm, timeout, seed, rss_limit_pct, aborts
    )
    rows: list[SoakRow] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pdctl-soak-") as scratch:
        for backend in backends:
            staging = {"pool_size_mb": pool_mb, "segment_size_mb": pool_mb / 4}
            path = variant(topology, backend, Path(scratch), staging, changes)
            plan = make_plan(load_checked(path))
            problems = unmet(plan.requirements)
            if problems:
                skipped[backend] = "; ".join(problems)
                continue
            progress(f"{backend}: starting {base.name} (staging ring {pool_mb:g} MiB per rank)")
            with make_run(plan).serving() as run:
                row: SoakRow = {"transport": backend, **soak_one(run, soak, progress)}
                rows.append(row)
            progress(f"{backend}: {'PASS' if row['passed'] else 'FAIL'}")
    return {
        "topology": base.name,
        "file": str(topology),
        "unique_prompts": unique,
        "new_tokens": new_tokens,
        "pool_mb": pool_mb,
        "timeout_s": timeout,
        "rss_limit_pct": rss_limit_pct,
        "abort_every": abort_every,
        "decode_pool_tokens": decode_pool_tokens,
        "rows": rows,
        "skipped": skipped,
        "passed": bool(rows) and all(r["passed"] for r in rows),
    }


def abort_faults(every: int | None, unique: int) -> list[Fault]:
    """The faults `--abort-every` adds: none, or `abort-transfer` sparing the rooms of
    the reference pass (its answers must be the clean ones)."""
    if every is None:
        return []
    return [{"name": "abort-transfer", "every": every, "after": unique}]
