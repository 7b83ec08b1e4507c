"""Run the verify passes against a target and collect findings.

The passes are a table (`passes.py`); each is checked as it ends: failed requests,
KV digests, and, for a compared pass, every request's tokens against the first
pass's. A role that dies ends the passes with a `role-died` finding. Once every
pass ran, each divergence is controlled before anything is blamed (`control.py`).
"""

from __future__ import annotations

import threading
import time

import httpx

from pdctl.engines import get_engine
from pdctl.verify.control import apply_controls
from pdctl.verify.diagnose import Finding, blocks, compare, digest_problems, request_failure
from pdctl.verify.passes import ONE_PASS, PASSES, Context, Pass, PassResult, RoleDied, Settings
from pdctl.verify.targets import Target
from pdctl.verify.transfer import ProofReader
from pdctl.verify.workload import Prompt


def run_passes(
    target: Target, prompts: list[Prompt], settings: Settings
) -> tuple[list[PassResult], list[Finding]]:
    client = httpx.Client(timeout=settings.timeout)
    engine = get_engine(settings.engine)
    ctx = Context(target, prompts, settings, client, dialect=engine.dialect)
    if engine.proof is not None:
        ctx.reader = ProofReader(engine.proof, target.role_urls(), client)
        missing = ctx.reader.missing()
        if missing is not None:
            why = f"the transfer cannot be proven ({engine.proof.source}): {missing}"
            ctx.findings.append(Finding("serial", "-", "kv-unproven", why))
            ctx.reader = None
    specs = PASSES if settings.serial_compare else ONE_PASS
    spec = specs[0]
    beside = {s.name: Beside(ctx, s) for s in specs[1:] if s.beside}
    try:
        for spec in specs:
            if spec.beside:  # started after the first pass; its result joins here
                ctx.passes.append(beside[spec.name].joined())
                ctx.alive()
            else:
                result = PassResult(spec.name)
                ctx.passes.append(result)  # partial results survive a role dying mid-pass
                _timed(ctx, spec, result)
            if ctx.passes[-1].skipped is None:
                check(ctx, spec, ctx.passes[-1])
            if spec is specs[0]:
                for other in beside.values():
                    other.start()
        apply_controls(ctx)
    except RoleDied as died:
        _role_died(ctx, spec, died)
    finally:
        ctx.stopped.set()
        for other in beside.values():
            other.stop()
        ctx.client.close()
    return ctx.passes, ctx.findings


def _timed(ctx: Context, spec: Pass, result: PassResult) -> None:
    started = time.perf_counter()
    spec.run(ctx, result)
    result.wall_s = time.perf_counter() - started


class Beside:
    """A pass on a thread of its own beside the passes after the first (`Pass.beside`):
    its result is checked on the runner's thread once it joins, in the table's order."""

    def __init__(self, ctx: Context, spec: Pass) -> None:
        self.ctx, self.spec = ctx, spec
        self.result = PassResult(spec.name)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"verify-{spec.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            _timed(self.ctx, self.spec, self.result)
        except BaseException as exc:  # re-raised on the runner's thread
            self.error = exc

    def stop(self) -> None:
        """Wait for the thread (it ends at its next prompt once `ctx.stopped` is set)."""
        if self.thread.ident is not None:
            self.thread.join()

    def joined(self) -> PassResult:
        """Its result once the thread ended (started with the first pass's end, always
        before its turn in the table); the thread's error raised here."""
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.result


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
