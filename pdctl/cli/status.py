"""`pdctl status [NAME]`: the runs on this host, each process's liveness and health."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options
from pdctl.errors import UsageError
from pdctl.launch import state


def status(
    ctx: typer.Context,
    name: Annotated[
        str | None, typer.Argument(help="A run or topology name (default: every run).")
    ] = None,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Show runs started by `pdctl up`; stale records of crashed runs are cleaned."""
    opts = options(ctx, json, verbose, quiet)
    runs = state.select(name)
    if name is not None and not runs:
        raise UsageError(f"no run named {name!r} on this host", hint="`pdctl status` lists them")
    report: list[dict[str, Any]] = []
    for run in runs:
        if run.stale:
            console.warning(
                f"{run.name}: no process of this run is alive (it crashed or was killed); "
                "its record is removed",
            )
            run.remove()
            report.append({"name": run.name, "topology": run.topology, "state": "stale"})
            continue
        health = run.health()
        healthy = all(v == "healthy" for v in health.values())
        report.append(
            {
                "name": run.name,
                "topology": run.topology,
                "state": "up" if healthy else "degraded",
                "router_url": run.data.get("router_url"),
                "age": state.age(run),
                "detached": run.data.get("detached", False),
                "run_dir": run.data.get("run_dir"),
                "processes": [
                    {
                        "name": p["name"],
                        "role": p["role"],
                        "pid": p["pid"],
                        "url": p["url"],
                        "health": health[p["name"]],
                    }
                    for p in run.processes
                ],
            }
        )
    if opts.json:
        console.emit_json(report)
        return
    live = [r for r in report if r["state"] != "stale"]
    if not live:
        console.info("no topology is up on this host")
        return
    for item in live:
        table = Table(
            title=f"{item['name']} ({item['topology']}): {item['state']}, up {item['age']}, "
            f"router {item['router_url']}",
            title_justify="left",
        )
        for column in ("process", "role", "pid", "url", "health"):
            table.add_column(column)
        for process in item["processes"]:
            mark = "green" if process["health"] == "healthy" else "red"
            shown = f"[{mark}]{process['health']}[/{mark}]"
            table.add_row(
                process["name"], process["role"], str(process["pid"]), process["url"], shown
            )
        console.out.print(table)
