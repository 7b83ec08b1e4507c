"""`pdctl validate FILE...`: check topology files, report every issue with its position."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options, report_issues
from pdctl.errors import ExitCode
from pdctl.launch.plan import load_checked
from pdctl.topology.issues import Issue, TopologyError


def validate(
    ctx: typer.Context,
    files: Annotated[list[Path], typer.Argument(help="Topology YAML files.", show_default=False)],
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Check topology files: exit 0 when all are valid, 2 otherwise."""
    opts = options(ctx, json, verbose, quiet)
    results: list[tuple[str, list[Issue], bool]] = []
    for path in files:
        try:
            loaded = load_checked(path)
            results.append((str(path), list(loaded.warnings), True))
        except TopologyError as exc:
            results.append((str(path), exc.issues, False))
    num_invalid = sum(1 for _, _, valid in results if not valid)
    if opts.json:
        console.emit_json(
            [
                {"file": file, "valid": valid, "issues": [i.to_json() for i in issues]}
                for file, issues, valid in results
            ]
        )
    else:
        for file, issues, valid in results:
            if issues:
                report_issues(TopologyError(issues))
            if valid:
                console.info(f"[green]ok[/green] {file}")
        total = len(results)
        summary = f"{total - num_invalid} of {total} topology file(s) valid"
        if num_invalid:
            console.err.print(f"[red]{summary}[/red]")
        else:
            console.info(summary)
    if num_invalid:
        raise typer.Exit(ExitCode.USAGE)
