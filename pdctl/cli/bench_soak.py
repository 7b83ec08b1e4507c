"""`pdctl bench soak`: parse, run the soak of each transport (launch/soak.py), render."""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from pdctl import console
from pdctl.cli.bench import chosen_backends
from pdctl.cli.common import Options, QuietOption, VerboseOption, options
from pdctl.errors import CheckFailed, UsageError
from pdctl.titles import short_title

if TYPE_CHECKING:  # the launch package loads with the command, not with the CLI
    from pdctl.launch.soak_report import SoakReport

DEFAULT_TOPOLOGY = Path("topologies/cpu-p1d2-tcp.yaml")


def soak(
    ctx: typer.Context,
    topology: Annotated[
        Path, typer.Argument(help="A CPU topology file (default: the default topology).")
    ] = DEFAULT_TOPOLOGY,
    requests: Annotated[int, typer.Option(min=1, help="Requests per transport.")] = 10000,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight.")] = 64,
    backends: Annotated[
        str, typer.Option(help="Transports, comma-separated.")
    ] = "tcp,mooncake,nixl",
    pool_mb: Annotated[
        float, typer.Option(min=0.01, help="Staging ring per decode rank (small: it wraps).")
    ] = 0.5,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per request.")] = 8,
    unique: Annotated[
        int, typer.Option(min=1, help="Distinct prompts (each run serially first: the reference).")
    ] = 48,
    warmup: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="RSS is sampled after this many requests and at the end "
            "(default: a fifth of --requests).",
        ),
    ] = None,
    rss_limit_pct: Annotated[
        float,
        typer.Option(min=0, help="Fail when any process's RSS grows this much after warm-up."),
    ] = 3.0,
    timeout: Annotated[float, typer.Option(min=1, help="Per-request timeout (s).")] = 120.0,
    abort_every: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Abort one room in N mid-transfer (fault abort-transfer): the others must "
            "stay token-exact, no digest may mismatch, the pools must come back.",
        ),
    ] = None,
    decode_pool_tokens: Annotated[
        int | None,
        typer.Option(
            min=32,
            help="Decode's KV pool, in tokens (default: the topology's; 2048 with "
            "--abort-every, so a page freed is handed out again at once).",
        ),
    ] = None,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Write the JSON report here ('-': stdout).")
    ] = None,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Many requests per transport: 0 failed, token-exact, pools back, RSS growth < 3 %."""
    opts = options(ctx, False, verbose, quiet)
    chosen = chosen_backends(backends)
    if warmup is not None and warmup > requests:
        raise UsageError(f"--warmup {warmup} is more than --requests {requests}")
    run_soak(topology, chosen, SoakFigures.from_params(ctx.params), json_file, opts)


@dataclass(frozen=True)
class SoakFigures:
    """The soak's figures as the command parsed them, named as `bench_soak` takes them."""

    requests: int
    concurrency: int
    pool_mb: float
    new_tokens: int
    unique: int
    warmup: int | None
    rss_limit_pct: float
    timeout: float
    abort_every: int | None
    decode_pool_tokens: int | None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> SoakFigures:
        """From the command's parameters as Click parsed them (`ctx.params`), every field
        by its name."""
        return cls(**{f.name: params[f.name] for f in fields(cls)})


def run_soak(
    topology: Path,
    backends: tuple[str, ...],
    figures: SoakFigures,
    json_file: Path | None,
    opts: Options,
) -> None:
    """Soak each transport, render (or write the JSON where asked), fail on any problem."""
    from pdctl.launch.soak import bench_soak

    progress = console.info if not opts.quiet else (lambda _: None)
    report = bench_soak(topology, backends=backends, progress=progress, **asdict(figures))
    if opts.json or str(json_file) == "-":
        console.emit_json(report)
    else:
        if json_file is not None:
            json_file.write_text(jsonlib.dumps(report, indent=2) + "\n")
        render(report)
    if not report["passed"]:
        raise CheckFailed(
            "the soak failed: " + "; ".join(reasons(report)),
            hint="the JSON report (--json FILE) has every figure",
        )


def reasons(report: SoakReport) -> list[str]:
    """What failed, one phrase per transport."""
    found = []
    for row in report["rows"]:
        what = []
        if row["failed"]:
            what.append(f"{row['failed']} failed (first: {row['first_failure']})")
        if row["mismatches"]:
            what.append(f"{row['mismatches']} answers differ from their reference")
        if report.get("abort_every") and not row.get("aborted"):
            what.append("no request was aborted")
        if not row["pools_back"]:
            what.append("not back: " + ", ".join(row["held"]))
        what += row["rss_problems"]
        if what:
            found.append(f"{row['transport']}: " + ", ".join(what))
    return found or ["no transport could run here (see the warnings)"]


def render(report: SoakReport) -> None:
    title = f"soak: {report['topology']}, ring {report['pool_mb']:g} MiB/rank"
    if report.get("abort_every"):
        title += f", one room in {report['abort_every']} aborted mid-transfer"
    table = Table(title=title)
    columns: tuple[str, ...] = ("transport", "requests", "aborted", "failed")
    columns += ("digest mismatches", "mismatches", "req/s", "p50 ms", "p99 ms", "pools back")
    columns += ("ring wraps", "max RSS growth %", "verdict")
    for column in columns:
        table.add_column(column, justify="left" if column == "transport" else "right")
    for row in report["rows"]:
        growth = row["rss_max_growth_pct"]
        table.add_row(
            row["transport"],
            str(row["requests"]),
            str(row["aborted"]),
            str(row["failed"]),
            str(row["digest_mismatches"]),
            str(row["mismatches"]),
            f"{row['requests_per_s']:.1f}",
            str(row["latency_ms_p50"]),
            str(row["latency_ms_p99"]),
            "yes" if row["pools_back"] else "NO",
            str(max(row["ring_wraps"].values(), default=0)),
            "-" if growth is None else f"{growth:.2f}",
            "PASS" if row["passed"] else "FAIL",
        )
    console.out.print(table)
    memory = Table(title=f"RSS per process (request {_warm(report)} -> end)")
    left = ("transport", "server", "process")
    for column in (*left, "pid", "MiB warm", "MiB end", "growth %", "threads"):
        memory.add_column(column, justify="left" if column in left else "right")
    for row in report["rows"]:
        for p in row["rss"]:
            threads = f"{p['threads_warm']} -> {p['threads_end']}"
            memory.add_row(
                row["transport"],
                p["server"],
                short_title(p["title"]),
                str(p["pid"]),
                f"{p['rss_warm_mib']:.1f}",
                f"{p['rss_end_mib']:.1f}",
                f"{p['growth_pct']:.2f}",
                threads,
            )
    console.out.print(memory)
    for backend, reason in report["skipped"].items():
        console.warning(f"{backend} not run: {reason}")


def _warm(report: SoakReport) -> str:
    return str(report["rows"][0]["rss_warmup_request"]) if report["rows"] else "-"
