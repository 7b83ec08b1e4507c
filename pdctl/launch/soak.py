"""`pdctl bench soak`: many requests through a PD topology, per transport, nothing lost.

For each transport the topology is launched with a staging ring small enough that
the soak wraps it many times. A set of distinct prompts of mixed lengths is sent
once, serially: the reference. Then `requests` requests drawn from that set run
`concurrency` at a time. The soak passes when no request failed, every output is
token-exact with its serial reference, the KV pools and staging rings are back to
full and empty at the end (`/get_server_info`), and no server's resident memory
(its whole process group: every TP rank) grew by 10 % or more from warm-up to end.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pdctl.launch.bench import variant
from pdctl.launch.launcher import make_run
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.processes import group_members
from pdctl.launch.requirements import unmet
from pdctl.launch.run import Run
from pdctl.topology import load_file

RSS_LIMIT_PCT = 10.0


def prompts_for(count: int, seed: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice((3, 15, 16, 17, 40, 64, 100, 150, 250, 400)) for _ in range(count)]
    return [[rng.randint(3, vocab - 1) for _ in range(n)] for n in lengths]


def rss_kib(pgid: int) -> int:
    total = 0
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/status") as handle:
                for line in handle:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def _generate(client: httpx.Client, url: str, prompt: list[int], new_tokens: int) -> Any:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    try:
        response = client.post(f"{url}/generate", json=body, timeout=300)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"{response.status_code}: {response.text[:300]}"
    return response.json()["output_ids"]


def soak_one(
    run: Run,
    prompts: list[list[int]],
    requests: int,
    concurrency: int,
    new_tokens: int,
    seed: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    url = run.router_url
    servers = [s for s in run.states if s.plan.role in ("prefill", "decode") and s.spawned]
    with httpx.Client() as client:
        reference = [_generate(client, url, p, new_tokens) for p in prompts]
    failed_reference = [r for r in reference if isinstance(r, str)]
    rss_start = {s.plan.name: rss_kib(s.spawned.pid) for s in servers if s.spawned}
    _, _, rings_start = run.pools_back()
    order = random.Random(seed).choices(range(len(prompts)), k=requests)
    progress(f"  {requests} requests, {concurrency} in flight")
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency * 2)
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(lambda i: _generate(client, url, prompts[i], new_tokens), order))
    wall = time.perf_counter() - started
    failures = [o for o in outputs if isinstance(o, str)]
    mismatches = sum(
        1
        for i, o in zip(order, outputs, strict=True)
        if not isinstance(o, str) and o != reference[i]
    )
    pools_ok, held, rings_end = run.pools_back()
    rss_end = {s.plan.name: rss_kib(s.spawned.pid) for s in servers if s.spawned}
    growth = {
        name: round(100.0 * (rss_end[name] - rss_start[name]) / max(rss_start[name], 1), 2)
        for name in rss_start
    }
    wraps = {
        name: ring["watermark"][0] - rings_start.get(name, {"watermark": [0]})["watermark"][0]
        for name, ring in rings_end.items()
    }
    row = {
        "requests": requests,
        "concurrency": concurrency,
        "failed": len(failures) + len(failed_reference),
        "first_failure": next(iter(failures or failed_reference), None),
        "mismatches": mismatches,
        "wall_s": round(wall, 2),
        "requests_per_s": round(requests / wall, 2),
        "tokens_per_s": round(requests * new_tokens / wall, 1),
        "pools_back": pools_ok,
        "held": held,
        "ring_wraps": wraps,
        "rss_start_mib": {k: round(v / 1024, 1) for k, v in rss_start.items()},
        "rss_growth_pct": growth,
    }
    row["passed"] = (
        row["failed"] == 0
        and mismatches == 0
        and pools_ok
        and all(g < RSS_LIMIT_PCT for g in growth.values())
    )
    return row


def bench_soak(
    topology: Path,
    *,
    backends: tuple[str, ...] = ("tcp", "mooncake", "nixl"),
    requests: int = 1000,
    concurrency: int = 32,
    unique: int = 48,
    new_tokens: int = 8,
    pool_mb: float = 0.5,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    base = load_file(topology).topology
    prompts = prompts_for(unique, seed)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pdctl-soak-") as scratch:
        for backend in backends:
            staging = {"pool_size_mb": pool_mb, "segment_size_mb": pool_mb / 4}
            plan = make_plan(load_checked(variant(topology, backend, Path(scratch), staging)))
            problems = unmet(plan.requirements)
            if problems:
                skipped[backend] = "; ".join(problems)
                continue
            progress(f"{backend}: starting {base.name} (staging ring {pool_mb:g} MiB per rank)")
            with make_run(plan).serving() as run:
                row = {"transport": backend}
                row.update(
                    soak_one(run, prompts, requests, concurrency, new_tokens, seed, progress)
                )
                rows.append(row)
                progress(f"{backend}: {'PASS' if row['passed'] else 'FAIL'}")
    return {
        "topology": base.name,
        "unique_prompts": unique,
        "new_tokens": new_tokens,
        "pool_mb": pool_mb,
        "rss_limit_pct": RSS_LIMIT_PCT,
        "rows": rows,
        "skipped": skipped,
        "passed": bool(rows) and all(r["passed"] for r in rows),
    }
