"""`pdctl logs [NAME] [PROCESS] [-f] [-n N]`: the log files of a run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from pdctl import console
from pdctl.cli.common import QuietOption, VerboseOption, options
from pdctl.errors import UsageError
from pdctl.launch import state
from pdctl.launch.processes import tail


def logs(
    ctx: typer.Context,
    name: Annotated[
        str | None, typer.Argument(help="A run or topology name (default: the newest run).")
    ] = None,
    process: Annotated[
        str | None,
        typer.Argument(help="A role or process (prefill, decode-0, router, ...); default all."),
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing.")] = False,
    lines: Annotated[int, typer.Option("-n", "--lines", min=0, help="Lines per log.")] = 40,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Print the last lines of each process's log (every TP rank has its own)."""
    options(ctx, False, verbose, quiet)
    runs = state.select(name)
    if not runs:
        raise UsageError(
            f"no run named {name!r} on this host" if name else "no run on this host",
            hint="`pdctl status` lists them; logs of ended runs stay in their run directory",
        )
    run = runs[-1]
    directory = Path(str(run.data["run_dir"]))
    files = sorted(directory.glob("*.log"))
    remote: dict[str, str] = {}
    if run.on_ray:  # servers on other hosts (or in node-local folders): ask their nodes
        from pdctl.launch.ray_launcher import recorded_log_tails

        here = {f.name.rsplit("-tp", 1)[0] for f in files}

        def wanted(name: str) -> bool:
            return name not in here and (process is None or name.startswith(process))

        remote = recorded_log_tails(run.data, lines, wanted)
        for name, text in remote.items():
            console.out.print(f"==> {name} (on its node) <==", markup=False, highlight=False)
            console.out.print(text, markup=False, highlight=False)
    if process is not None:
        files = [f for f in files if f.name.startswith(process)]
        if not files and not remote:
            known = {f.name.rsplit("-tp", 1)[0] for f in directory.glob("*.log")}
            known |= {str(p["name"]) for p in run.data.get("processes", [])}
            raise UsageError(
                f"run {run.name} has no process {process!r}",
                hint=f"choose from {', '.join(sorted(known))}",
            )
    for path in files:
        console.out.print(f"==> {path} <==", markup=False, highlight=False)
        text = tail(path, lines)
        if text:
            console.out.print(text, markup=False, highlight=False)
    if not follow:
        return
    if remote:
        console.warning(
            "--follow follows the logs on this host; the others are copied here at `pdctl down`"
        )
    offsets = {path: path.stat().st_size for path in files}
    try:
        while True:
            for path in files:
                size = path.stat().st_size
                if size > offsets[path]:
                    with open(path, "rb") as handle:
                        handle.seek(offsets[path])
                        chunk = handle.read().decode(errors="replace")
                    offsets[path] = size
                    for line in chunk.splitlines():
                        console.out.print(f"{path.stem}| {line}", markup=False, highlight=False)
            if run.stale:
                console.info(f"{run.name} has stopped")
                return
            time.sleep(0.3)
    except KeyboardInterrupt:
        return
