"""`pdctl verify [FILE] --serial-compare`: is this PD topology right, token for token?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from pdctl import console
from pdctl.cli.common import QuietOption, VerboseOption, options
from pdctl.errors import CheckFailed
from pdctl.verify import session
from pdctl.verify.report import Report

VERDICT_STYLE = {"pass": "green", "fail": "red", "error": "red", "skipped": "yellow"}


def verify(
    ctx: typer.Context,
    file: Annotated[
        Path | None,
        typer.Argument(
            help="Topology to launch, verify and tear down (default: the run up).",
            show_default=False,
        ),
    ] = None,
    serial_compare: Annotated[
        bool,
        typer.Option(
            "--serial-compare/--no-serial-compare",
            help="Serial, repeated, concurrent and prefix-hit passes compared token "
            "for token (off: one concurrent pass checking requests and digests).",
        ),
    ] = True,
    running: Annotated[
        str | None, typer.Option(help="Verify this run of `pdctl up` (never torn down).")
    ] = None,
    url: Annotated[
        str | None, typer.Option(help="Verify any PD router with the same API at this URL.")
    ] = None,
    reference: Annotated[
        bool | None,
        typer.Option(
            "--reference/--no-reference",
            help="Also compare with a colocated server of the same model.",
        ),
    ] = None,
    inject: Annotated[
        list[str] | None,
        typer.Option(
            help="Inject a fault: NAME[:KEY=VALUE,...] (corrupt-kv, drop-scatter, "
            "delay-transfer, kill-role); repeatable."
        ),
    ] = None,
    num_prompts: Annotated[int | None, typer.Option(min=1, help="Prompts in the workload.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(min=1, help="Tokens per prompt.")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Requests in flight.")] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="Seed of the workload.")] = None,
    near_tie_margin: Annotated[
        float, typer.Option(min=0, help="Logprob margin below which a mismatch is a near-tie.")
    ] = 0.05,
    timeout: Annotated[float | None, typer.Option(min=1, help="Per-request timeout (s).")] = None,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Write the JSON report here ('-': stdout).")
    ] = None,
    junit: Annotated[Path | None, typer.Option(help="Write a JUnit XML report here.")] = None,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Check a PD topology: token-exact passes, KV digests, diagnosis of every mismatch."""
    opts = options(ctx, False, verbose, quiet)
    stdout_json = opts.json or str(json_file) == "-"
    chosen = session.Options(
        file=file,
        running=running,
        url=url,
        inject=list(inject or []),
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        concurrency=concurrency,
        seed=seed,
        reference=reference,
        serial_compare=serial_compare,
        near_tie=near_tie_margin,
        timeout=timeout,
    )
    progress = console.info if not (opts.quiet or stdout_json) else (lambda _: None)
    conclude(session.verify(chosen, progress), json_file, junit, stdout_json)


def conclude(report: Report, json_file: Path | None, junit: Path | None, stdout: bool) -> None:
    """Write the reports, show the verdict, and fail the command on what blocks."""
    _write(report, json_file, junit, stdout)
    if report.error is not None:  # the launch failed, or this machine cannot run it
        raise report.error
    if not stdout:
        render(report)
    if report.verdict == "fail":
        raise CheckFailed(
            f"{len(report.blocking)} problem(s) found",
            hint="the JSON report (--json FILE) has every request and the evidence",
        )


def _write(report: Report, json_file: Path | None, junit: Path | None, stdout: bool) -> None:
    if stdout:
        console.emit_json(report.to_json())
    elif json_file is not None:
        report.write_json(json_file)
    if junit is not None:
        report.write_junit(junit)


def render(report: Report) -> None:
    target = report.target
    name = target.get("topology") or target.get("run") or target.get("router_url")
    table = Table(title=f"pdctl verify {name} ({target.get('mode')})", title_justify="left")
    for column in ("pass", "requests", "ok", "findings", "wall s", "p50 ms", "p95 ms"):
        table.add_column(column, justify="left" if column == "pass" else "right")
    for run in report.passes:
        if run.skipped:
            continue
        timing = run.timing()
        mine = [f for f in report.findings if f.pass_name == run.name]
        table.add_row(
            run.name,
            str(len(run.results)),
            str(sum(r.ok for r in run.results)),
            str(len(mine)) if mine else "0",
            f"{timing['wall_s']:.2f}",
            f"{timing.get('p50_ms', 0):.0f}",
            f"{timing.get('p95_ms', 0):.0f}",
        )
    console.out.print(table)
    moved = kv_summary(report)
    if moved:
        console.out.print(moved, markup=False)
    for run in report.passes:
        if run.skipped:
            console.out.print(f"{run.name}: skipped ({run.skipped})", markup=False)
    for finding in report.findings[:20]:
        mark = "red" if finding in report.blocking else "yellow"
        console.out.print(
            f"[{mark}]{finding.classification}[/{mark}] {finding.pass_name} "
            f"{finding.request}: {escape(finding.message)}"
        )
        for line in evidence_lines(finding.evidence):
            console.out.print(f"    {line}", markup=False)
    if len(report.findings) > 20:
        console.out.print(f"... and {len(report.findings) - 20} more (see the JSON report)")
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in report.phases.items())
    style = VERDICT_STYLE.get(report.verdict, "")
    console.out.print(f"[{style}]{report.verdict.upper()}[/{style}]  ({phases})")


def evidence_lines(evidence: dict[str, Any]) -> list[str]:
    """A mismatch's tokens, the top-5 at its first divergence, and the control's tokens."""
    if "expected" not in evidence:
        return []
    start = evidence["window_start"]
    lines = [
        f"tokens from {start}: expected {evidence['expected']}, got {evidence['got']}; top-5 "
        f"there: baseline {evidence['baseline_top5']}, this run {evidence['run_top5']}"
    ]
    control = evidence.get("control")
    if isinstance(control, dict) and control.get("ran"):
        window = slice(start, start + len(evidence["expected"]))
        lines.append(
            f"control (no KV transfer) from {start}: {control['baseline_state']}: "
            f"{control['baseline_state_output_ids'][window]}; {control['run_state']}: "
            f"{control['output_ids'][window]}"
        )
    elif isinstance(control, dict):
        lines.append(f"control: did not run ({control.get('reason')})")
    return lines


def kv_summary(report: Report) -> str | None:
    """One line on how the first pass's KV moved: transport, path, bytes, and prefill's
    write time (median, and the largest transfer's rate), when the router reports it."""
    transfers = next(
        (
            [r.kv_transfer for r in run.results if r.ok and r.kv_transfer]
            for run in report.passes
            if not run.skipped and any(r.kv_transfer for r in run.results)
        ),
        [],
    )
    if not transfers:
        return None
    total = sum(t.bytes or 0 for t in transfers)
    transports = ", ".join(sorted({str(t.transport) for t in transfers}))
    paths = sorted({"staging" if t.staging else "direct" for t in transfers})
    line = (
        f"KV: {len(transfers)} transfers over {transports} ({', '.join(paths)}, up to "
        f"{max(t.segments or 0 for t in transfers)} segments), "
        f"{total / (1 << 20):.2f} MiB in all"
    )
    rung = sum(1 for t in transfers if t.notice == "bell")
    if rung:  # what engaged: decode told by its doorbell, not a message
        line += f"; {rung} told by doorbell"
    timed = [t for t in transfers if t.write_ms is not None]
    if timed:
        writes = sorted(float(t.write_ms or 0) for t in timed)
        largest = max(timed, key=lambda t: t.bytes or 0)
        largest_ms = float(largest.write_ms or 0)
        gbps = (largest.bytes or 0) / 1e6 / max(largest_ms, 1e-3)  # MB/ms
        line += (
            f"; prefill write p50 {writes[len(writes) // 2]:.1f} ms, the largest "
            f"({(largest.bytes or 0) / (1 << 20):.2f} MiB) {largest_ms:.1f} ms "
            f"= {gbps:.3f} GB/s"
        )
    return line
