"""`pdctl down NAME | --all`: end runs by process group, then check nothing is left."""

from __future__ import annotations

from typing import Annotated

import typer

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options
from pdctl.errors import LaunchError, UsageError
from pdctl.launch import state


def down(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(help="A run or topology name.")] = None,
    all_runs: Annotated[bool, typer.Option("--all", help="Every run on this host.")] = False,
    grace: Annotated[float, typer.Option(min=0, help="Seconds between TERM and KILL.")] = 5.0,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Stop runs: TERM each process group, wait, KILL, and confirm nothing survived."""
    opts = options(ctx, json, verbose, quiet)
    if (name is None) == (not all_runs):
        raise UsageError(
            "name one run (or topology) or pass --all", hint="`pdctl status` lists the runs"
        )
    runs = state.select(None if all_runs else name)
    if name is not None and not runs:
        raise UsageError(f"no run named {name!r} on this host", hint="`pdctl status` lists them")
    stopped, survivors = [], []
    for run in runs:
        groups, remaining = run.stop(grace)
        if remaining:
            survivors.append(f"{run.name}: pids {', '.join(map(str, remaining))}")
            continue
        run.remove()
        stopped.append(run.name)
        if groups:
            console.info(f"stopped {run.name} ({groups} process groups, nothing left)")
        else:
            console.info(f"{run.name} was not running any more; its record is removed")
    if opts.json:
        console.emit_json({"stopped": stopped, "survivors": survivors})
    if survivors:
        raise LaunchError("still alive after KILL: " + "; ".join(survivors))
    if not runs:
        console.info("no topology is up on this host")
