"""`pdctl plan FILE`: every process pdctl would start, without starting anything."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options, report_issues
from pdctl.engines import get_engine
from pdctl.engines.command import render_command
from pdctl.launch.plan import LaunchPlan, ProcessPlan, load_checked, make_plan
from pdctl.topology.issues import TopologyError


def plan(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Topology YAML file.", show_default=False)],
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Show the resolved launch plan: processes, devices, ports, environment, commands."""
    opts = options(ctx, json, verbose, quiet)
    launch_plan = make_plan(load_checked(file))
    if launch_plan.warnings:
        report_issues(TopologyError(list(launch_plan.warnings)))
    if opts.json:
        console.emit_json(launch_plan.to_json())
    else:
        render(launch_plan)


def _summary(launch_plan: LaunchPlan) -> list[str]:
    topology = launch_plan.topology
    transfer = topology.transfer
    engine = get_engine(topology.engine)
    model = topology.model.path or f"preset {topology.model.preset}"
    reqs = launch_plan.requirements
    needs = [f"{reqs.device_count} x {reqs.device_type}" if reqs.device_count else "cpu"]
    needs += [*reqs.modules, *reqs.capabilities]
    if reqs.cpu_cores:
        needs.append(f"{reqs.cpu_cores} cores")
    if reqs.engine_modules:
        needs.append(f"{', '.join(reqs.engine_modules)} in the engine's environment")
    lines = [
        f"topology  {topology.name}  ({launch_plan.loaded.file})",
        f"engine    {topology.engine}, model {model}, dtype {topology.effective_dtype}, "
        f"device {topology.device}",
        f"python    {launch_plan.engine_python}",
        f"transfer  {transfer.backend}"
        + (f" over {transfer.effective_protocol}" if transfer.backend == "mooncake" else "")
        + f", {engine.describe_staging(topology)}",
        f"serving   {engine.describe_serving(topology)}",
        f"router    {topology.router.kind} at {launch_plan.router_url}",
        f"requires  {', '.join(needs)}",
    ]
    lines += [f"prepare   {step.what}" for step in launch_plan.preparations]
    return lines


def _process_table(launch_plan: LaunchPlan) -> Table:
    table = Table(title="processes", title_justify="left", show_lines=False)
    for column in ("process", "ranks (device)", "cores", "ports"):
        table.add_column(column)
    fixed = launch_plan.fixed_ports
    for process in launch_plan.processes:
        ranks = ", ".join(
            f"tp{r.rank}"
            + (f" ({launch_plan.topology.device}:{r.device})" if r.device is not None else "")
            for r in process.ranks
        )
        ports = ", ".join(
            f"{slot.name}={fixed.get(slot.key, 'at launch')}" for slot in process.ports
        )
        cores = ",".join(str(core) for core in process.cores) or "any"
        table.add_row(process.name, ranks, cores, ports)
    return table


def _process_detail(process: ProcessPlan, fixed: dict[str, int]) -> None:
    out = console.out
    out.print(f"\n[bold]{escape(process.name)}[/bold]  [dim]{escape(process.ranks[0].title)}[/dim]")
    out.print("  environment (changes to the parent environment):")
    parent = os.environ
    for entry in process.env:
        if not entry.secret and parent.get(entry.name) == entry.value:
            continue
        origin = f"from {entry.source}"
        if entry.overrides:
            origin += f", overrides {entry.overrides}"
        if not entry.secret and entry.name in parent:
            origin += f", parent had {parent[entry.name]!r}"
        out.print(f"    {escape(entry.name)}={escape(entry.shown())}  [dim]{escape(origin)}[/dim]")
    out.print("  command:")
    args = render_command(process.command, fixed)
    lines, current = [], "   "
    for arg in args:
        if arg.startswith("--") and current.strip():
            lines.append(current)
            current = "     "
        current += " " + (arg if " " not in arg else repr(arg))
    lines.append(current)
    out.print(" \\\n".join(lines), markup=False)
    out.print("  readiness (then a 1-token canary through the router):")
    for probe in process.probes:
        out.print(f"    {probe.describe(fixed)}", markup=False)


def render(launch_plan: LaunchPlan) -> None:
    for line in _summary(launch_plan):
        console.out.print(line, markup=False)
    console.out.print(_process_table(launch_plan))
    for process in launch_plan.processes:
        _process_detail(process, launch_plan.fixed_ports)
