"""`pdctl nightly [PATH...] --suite NAME`: verify a suite, skipping what cannot run here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from pdctl import console
from pdctl.cli.common import QuietOption, VerboseOption, options
from pdctl.errors import CheckFailed
from pdctl.verify import session
from pdctl.verify.nightly import run_nightly, summary, write_junit

STYLE = {"pass": "green", "skipped": "yellow", "fail": "red", "error": "red", "invalid": "red"}


def nightly(
    ctx: typer.Context,
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Topology files or directories (default: topologies/).", show_default=False
        ),
    ] = None,
    suite: Annotated[
        str | None, typer.Option(help="Only topologies whose `suites:` has this tag.")
    ] = None,
    junit: Annotated[Path | None, typer.Option(help="One JUnit XML for the whole run.")] = None,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="The JSON summary here ('-': stdout).")
    ] = None,
    fail_fast: Annotated[bool, typer.Option(help="Stop at the first failure.")] = False,
    num_prompts: Annotated[int | None, typer.Option(min=1, help="Prompts per topology.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(min=1, help="Tokens per prompt.")] = None,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Verify every topology of a suite; skips carry their reason; exit 1 only on failures."""
    opts = options(ctx, False, verbose, quiet)
    stdout_json = opts.json or str(json_file) == "-"
    progress = console.info if not (opts.quiet or stdout_json) else (lambda _: None)
    overrides = session.Options(num_prompts=num_prompts, max_new_tokens=max_new_tokens)
    outcomes = run_nightly(
        paths or [Path("topologies")],
        suite,
        fail_fast=fail_fast,
        progress=progress,
        overrides=overrides,
    )
    data = summary(outcomes, suite)
    if junit is not None:
        write_junit(outcomes, suite, junit)
    if stdout_json:
        console.emit_json(data)
    else:
        if json_file is not None:
            import json

            json_file.parent.mkdir(parents=True, exist_ok=True)
            json_file.write_text(json.dumps(data, indent=2) + "\n")
        table = Table(title=f"pdctl nightly: {suite or 'every suite'}", title_justify="left")
        for column in ("topology", "verdict", "seconds", "reason"):
            table.add_column(column)
        for outcome in outcomes:
            style = STYLE.get(outcome.verdict, "")
            table.add_row(
                outcome.name,
                f"[{style}]{outcome.verdict}[/{style}]",
                f"{outcome.seconds:.1f}" if outcome.seconds else "-",
                escape(outcome.reason or ""),
            )
        console.out.print(table)
        counts = ", ".join(f"{n} {verdict}" for verdict, n in sorted(data["counts"].items()))
        console.out.print(f"{data['verdict'].upper()}: {counts or 'no topology selected'}")
    failed = [o for o in outcomes if o.failed]
    if failed:
        raise CheckFailed(
            f"{len(failed)} topolog{'y' if len(failed) == 1 else 'ies'} failed: "
            + ", ".join(o.name for o in failed)
        )
