"""Run the verify passes against a target and collect findings.

The passes are a table (`passes.py`); each is checked as it ends: failed requests,
KV digests, and, for a compared pass, every request's tokens against the first
pass's. A role that dies ends the passes with a `role-died` finding. Once every
pass ran, each divergence is controlled before anything is blamed (`control.py`).
"""

from __future__ import annotations

import time

import httpx

from pdctl.verify.control import apply_controls
from pdctl.verify.diagnose import Finding, blocks, compare, digest_problems, request_failure
from pdctl.verify.passes import ONE_PASS, PASSES, Context, Pass, PassResult, RoleDied, Settings
from pdctl.verify.targets import Target
from pdctl.verify.workload import Prompt


def run_passes(
    target: Target, prompts: list[Prompt], settings: Settings
) -> tuple[list[PassResult], list[Finding]]:
    ctx = Context(target, prompts, settings, httpx.Client(timeout=settings.timeout))
    spec = PASSES[0]
    try:
        for spec in PASSES if settings.serial_compare else ONE_PASS:
            result = PassResult(spec.name)
            ctx.passes.append(result)  # partial results survive a role dying mid-pass
            started = time.perf_counter()
            spec.run(ctx, result)
            result.wall_s = time.perf_counter() - started
            if not result.skipped:
                check(ctx, spec, result)
        apply_controls(ctx)
    except RoleDied as died:
        _role_died(ctx, spec, died)
    finally:
        ctx.client.close()
    return ctx.passes, ctx.findings


def check(ctx: Context, spec: Pass, run: PassResult) -> None:
    """Failed requests, digests, and tokens against the first pass where `spec` compares."""
    first = ctx.passes[0]
    baseline = {r.prompt.id: r for r in first.results} if spec.compared else {}
    for result in run.results:
        if not result.ok:
            ctx.findings.append(request_failure(run.name, result))
            continue
        problem = digest_problems(run.name, result)
        if problem is not None:
            ctx.findings.append(problem)
            continue  # kv-corruption: its tokens say nothing more
        base = baseline.get(result.prompt.id)
        if base is None or not base.ok:
            continue
        found = compare(
            run.name, base, result, ctx.settings.near_tie, spec.repeat, ctx.settings.compute_dtype
        )
        if found is not None:
            ctx.findings.append(found)


def _role_died(ctx: Context, spec: Pass, died: RoleDied) -> None:
    """Check what the pass got before the role died, and say which role it was."""
    current = ctx.passes[-1]
    current.wall_s = current.wall_s or sum(r.latency_ms for r in current.results) / 1e3
    check(ctx, spec, current)
    role = next((r for r in ("prefill", "decode", "router") if r in str(died)), "router")
    ctx.findings.append(Finding(current.name, "-", "role-died", str(died), evidence={"role": role}))


def blocking(findings: list[Finding], settings: Settings) -> list[Finding]:
    """The findings that fail verification (numerics only under deterministic serving)."""
    return [f for f in findings if blocks(f, settings.deterministic)]
