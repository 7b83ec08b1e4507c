"""`pdctl up FILE`: bring a topology up on this host and keep it up (or `--detach`)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options, report_issues
from pdctl.errors import ExitCode, RequirementsUnmet
from pdctl.launch.launcher import make_run
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.requirements import unmet
from pdctl.launch.run import Run
from pdctl.topology.issues import TopologyError

STAGE_STYLE = {"starting": "dim", "alive": "yellow", "healthy": "cyan", "ready": "green"}


class Stopped(Exception):
    """SIGINT or SIGTERM arrived: tear down."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Stopped` in the main thread, wherever it is."""

    def handler(signum: int, _: FrameType | None) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def progress_table(run: Run) -> Table:
    table = Table(title=f"{run.plan.topology.name}: starting", title_justify="left")
    for column in ("process", "role", "stage", "for", "last check"):
        table.add_column(column)
    now = time.monotonic()
    for state in run.states:
        style = STAGE_STYLE.get(state.stage, "")
        table.add_row(
            state.plan.name,
            state.plan.role,
            f"[{style}]{state.stage}[/{style}]",
            f"{now - state.since:.1f} s",
            state.detail if state.stage != "ready" else "",
        )
    return table


def endpoints_table(run: Run) -> Table:
    table = Table(title=f"{run.plan.topology.name} is up ({run.name})", title_justify="left")
    for column in ("endpoint", "url", "pid", "log"):
        table.add_column(column)
    router = run.state("router")
    ordered = [router, *[s for s in run.states if s is not router]]
    for state in ordered:
        assert state.spawned is not None
        table.add_row(
            f"{state.plan.name} ({state.plan.role})",
            state.url,
            str(state.spawned.pid),
            str(state.spawned.log_path),
        )
    return table


def wait_with_display(run: Run, timeout: float | None, quiet: bool) -> None:
    if quiet:
        run.wait_ready(timeout)
        return
    if console.err.is_terminal:
        with Live(progress_table(run), console=console.err, refresh_per_second=8) as live:
            ticker = threading.Event()

            def refresh() -> None:
                while not ticker.wait(0.25):
                    live.update(progress_table(run))

            thread = threading.Thread(target=refresh, daemon=True)
            thread.start()
            try:
                run.wait_ready(timeout, on_change=lambda r: live.update(progress_table(r)))
            finally:
                ticker.set()
                thread.join()
                live.update(progress_table(run))
        return
    seen: dict[str, str] = {}

    def lines(current: Run) -> None:
        for state in current.states:
            if seen.get(state.plan.name) != state.stage:
                seen[state.plan.name] = state.stage
                elapsed = time.time() - current.started_at
                console.info(f"{elapsed:6.1f} s  {state.plan.name:<12} {state.stage}")

    run.wait_ready(timeout, on_change=lines)


def up(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Topology YAML file.", show_default=False)],
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Return once ready; `pdctl down` ends it.")
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(min=1, help="Start-up timeout in seconds (default: the topology's)."),
    ] = None,
    run_dir: Annotated[
        Path | None, typer.Option(help="Logs and run.json here (default: runs/<run>).")
    ] = None,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Start every process of a topology and wait until it really serves PD requests."""
    opts = options(ctx, json, verbose, quiet)
    plan = make_plan(load_checked(file))
    if plan.warnings:
        report_issues(TopologyError(list(plan.warnings)))
    problems = unmet(plan.requirements)
    if problems:
        raise RequirementsUnmet(
            f"{plan.topology.name} cannot run on this machine: " + "; ".join(problems),
            hint="`pdctl doctor` shows what this machine has",
        )
    run = make_run(plan, run_dir, detach=detach)
    up_since = None
    with stop_on_signals():
        try:
            run.start()
            wait_with_display(run, timeout, opts.quiet or opts.json)
            for warning in run.warnings:
                console.warning(warning)
            up_since = time.monotonic()
            report(run, opts.json)
            if detach:
                return
            console.info("serving; Ctrl-C or SIGTERM stops it")
            run.watch(threading.Event())  # until a signal, or a process exits (LaunchFailed)
        except Stopped as stopped:
            left = run.stop()
            _report_stop(left)
            if up_since is None:  # interrupted while starting
                console.error(f"{stopped}: start-up interrupted, everything stopped")
                raise typer.Exit(ExitCode.INTERRUPTED) from None
            console.info(f"{stopped}: stopped {plan.topology.name}")
            return
        except BaseException:
            if not (detach and up_since is not None):
                _report_stop(run.stop())
            raise


def _report_stop(left: list[str]) -> None:
    if left:
        console.error(f"still alive after KILL: {', '.join(left)}")


def report(run: Run, as_json: bool) -> None:
    data: dict[str, Any] = run.to_json()
    if as_json:
        data.pop("plan", None)
        console.emit_json(data)
        return
    console.out.print(endpoints_table(run))
    if run.canary:
        console.info(f"canary request through the router: {run.canary['ms']:.0f} ms")
