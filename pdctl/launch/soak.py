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
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pdctl.launch import rss
from pdctl.launch.bench import refuse_other_engines, variant
from pdctl.launch.launcher import make_run
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.requirements import unmet
from pdctl.launch.run import Run
from pdctl.launch.soak_load import ABORTED, Load, Outcome, generate
from pdctl.records import ServerInfo
from pdctl.topology import load_file

RSS_LIMIT_PCT = 3.0
LENGTHS = (3, 15, 16, 17, 40, 64, 100, 150, 250, 400)  # around page and segment edges
ABORT_MARKS = (ABORTED, "abort-transfer")  # how an aborted request's answer reads
CORRUPTION_MARK = "KV corruption"  # a digest that did not match, as decode words it
# With aborts, decode's KV pool (tokens) unless given: a few of the longest prompts
# fit, so under load a page freed is handed out again at once (first in, first out
# reuse alone would hide a late write in a page nobody holds). Prefill keeps the
# topology's: with both pools page-bound, prefill can fill with rooms decode has no
# pages for while decode fills with rooms prefill has not computed, each side waiting
# on the other until the bootstrap timeout (measured: 122 of 2,200 requests, no abort)
ABORT_POOL_TOKENS = 2048


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


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def _groups(run: Run) -> dict[str, int]:
    return {s.plan.name: s.spawned.pid for s in run.states if s.spawned is not None}


def soak_one(
    run: Run,
    *,
    requests: int,
    concurrency: int,
    unique: int,
    new_tokens: int,
    warmup: int,
    timeout: float,
    seed: int,
    rss_limit_pct: float,
    progress: Callable[[str], None],
    aborts: bool = False,
) -> dict[str, Any]:
    url = run.router_url
    vocab, context = served_shape(run)
    prompts = prompts_for(unique, seed, vocab, max(1, context - new_tokens))
    with httpx.Client() as client:
        reference = [generate(client, url, p, new_tokens, timeout) for p in prompts]
    _, _, rings_start = run.pools_back()
    order = random.Random(seed).choices(range(len(prompts)), k=requests)
    samples: dict[str, list[rss.ProcessRss]] = {}
    trace: list[tuple[int, list[rss.ProcessRss]]] = []  # every tenth: leak or high water?

    def on_done(done: int) -> None:
        if done == warmup:
            samples["warm"] = rss.sample(_groups(run))
            progress(f"  {done}/{requests} done: RSS sampled (warm-up)")
        elif done % max(1, requests // 10) == 0 and done < requests:
            progress(f"  {done}/{requests} done")
        if done % max(1, requests // 10) == 0 or done in (warmup, requests):
            trace.append((done, rss.sample(_groups(run))))
        if done == requests:
            samples["end"] = trace[-1][1]

    progress(f"  {requests} requests, {concurrency} in flight, {unique} distinct prompts")
    load = Load(
        url,
        prompts,
        order,
        concurrency=concurrency,
        new_tokens=new_tokens,
        timeout=timeout,
        on_done=on_done,
    )
    started = time.perf_counter()
    try:  # a Ctrl-C while the workers start stops them too (else they send on, forever)
        load.start()
        load.wait(run.check_exits)
    except BaseException:  # Ctrl-C, a dead server: the run's owner stops the servers now,
        load.close(grace=0)  # which ends the requests in flight; no wait for them here
        raise
    load.close(grace=timeout)
    wall = time.perf_counter() - started
    if load.callback_error is not None:
        raise load.callback_error
    row: dict[str, Any] = {"requests": requests, "concurrency": concurrency, "vocab": vocab}
    row.update(_answers(reference, load.outcomes, requests, aborts))
    row.update(_rates(load.outcomes, wall, new_tokens))
    pools_ok, held, rings_end = run.pools_back()
    row.update(pools_back=pools_ok, held=held, ring_wraps=_wraps(rings_start, rings_end))
    row["fences"] = fences(run)
    row.update(_memory(samples, warmup, requests, rss_limit_pct))
    _add_trace(row["rss"], trace)
    row["passed"] = (
        row["failed"] == 0 and row["mismatches"] == 0 and pools_ok and not row["rss_problems"]
    ) and (not aborts or row["aborted"] > 0)
    return row


def _answers(
    reference: list[tuple[list[int] | None, str | None]],
    outcomes: list[Outcome],
    requests: int,
    aborts: bool = False,
) -> dict[str, Any]:
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


def _rates(outcomes: list[Outcome], wall: float, new_tokens: int) -> dict[str, Any]:
    latencies = [o.latency_s * 1e3 for o in outcomes]
    return {
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(outcomes) / wall, 2),
        "tokens_per_s": round(len(outcomes) * new_tokens / wall, 1),
        "latency_ms_p50": round(statistics.median(latencies), 1) if latencies else None,
        "latency_ms_p99": round(_percentile(latencies, 0.99), 1) if latencies else None,
    }


def _memory(
    samples: dict[str, list[rss.ProcessRss]], warmup: int, requests: int, limit_pct: float
) -> dict[str, Any]:
    rows, problems = rss.growth(samples.get("warm", []), samples.get("end", []), limit_pct)
    if "warm" not in samples or "end" not in samples:
        problems.append(f"RSS not sampled at requests {warmup} and {requests}")
    return {
        "rss_warmup_request": warmup,
        "rss": rows,
        "rss_max_growth_pct": max((float(r["growth_pct"]) for r in rows), default=None),
        "rss_problems": problems,
    }


def _add_trace(rows: list[dict[str, Any]], trace: list[tuple[int, list[rss.ProcessRss]]]) -> None:
    """Each process's RSS (MiB) at every tenth of the load: a leak climbs all the way,
    a high-water mark (the largest batch so far) steps up and stays."""
    for row in rows:
        row["trace_mib"] = {
            done: round(p.rss_kib / 1024, 1)
            for done, found in trace
            for p in found
            if p.pid == row["pid"]
        }


def _wraps(start: dict[str, Any], end: dict[str, Any]) -> dict[str, int]:
    return {
        name: ring["watermark"][0] - start.get(name, {"watermark": [0]})["watermark"][0]
        for name, ring in end.items()
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
) -> dict[str, Any]:
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
    changes: dict[str, Any] = {"faults": abort_faults(abort_every, unique)}
    if decode_pool_tokens is not None:
        changes["roles"] = {"decode": {"kv_pool_tokens": decode_pool_tokens}}
    rows: list[dict[str, Any]] = []
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
                row: dict[str, Any] = {"transport": backend}
                row.update(
                    soak_one(
                        run,
                        requests=requests,
                        concurrency=concurrency,
                        unique=unique,
                        new_tokens=new_tokens,
                        warmup=warm,
                        timeout=timeout,
                        seed=seed,
                        rss_limit_pct=rss_limit_pct,
                        progress=progress,
                        aborts=abort_every is not None,
                    )
                )
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


def abort_faults(every: int | None, unique: int) -> list[dict[str, Any]]:
    """The faults `--abort-every` adds: none, or `abort-transfer` sparing the rooms of
    the reference pass (its answers must be the clean ones)."""
    if every is None:
        return []
    return [{"name": "abort-transfer", "every": every, "after": unique}]
