"""`pdctl doctor [FILE...]`: what this machine can run (a report; always exits 0).

Without files: torch, Triton, devices and each transport as pdctl's interpreter finds
them, and every settings table (each row's default, and the value this environment
gives it; `-v` lists every row). With topology files: also each one's engine
environment, asked of the engine's own interpreter (`engine_python`): its Python, the
versions installed, and whether the KV connector imports there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options
from pdctl.engines import get_engine
from pdctl.launch.engine_env import EngineEnv, EngineEnvJson, probe
from pdctl.launch.plan import load_checked, make_plan
from pdctl.settings import HANDOFF, PREFIX, RUN_SECRET_VAR, SettingRow, row_json, variable_of

Tables = dict[str, list[SettingRow]]  # table -> its rows


class EngineReport(EngineEnvJson):
    """One topology's engine environment."""

    topology: str
    engine: str


if TYPE_CHECKING:  # staging.capabilities imports torch: it loads with the command
    from pdctl.staging.capabilities import (
        MachineReport,
        MooncakeReport,
        TransportReport,
        TransportsReport,
    )

    class DoctorReport(MachineReport):
        """`pdctl doctor --json`: the machine, then what pdctl made of it."""

        capabilities: list[str]
        engines: list[EngineReport]
        settings: Tables
        unknown_variables: list[str]


def tent_line(info: MooncakeReport) -> str:
    """What the Transfer Engine did when asked for TENT, as the engine showed it."""
    engine = info.get("tent_engine")
    ran = engine["implementation"] if engine else "unknown"
    if info.get("tent_engaged"):
        return "TENT engaged (the engine ran TENT)"
    if info.get("tent_requested"):
        return f"TENT requested, not engaged (the engine ran its {ran} implementation)"
    if info.get("tent_available"):
        return "TENT available, not requested"
    return f"TENT not available (asked for it, the engine ran its {ran} implementation)"


def doctor(
    ctx: typer.Context,
    files: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Topology files whose engine environment to check.", show_default=False
        ),
    ] = None,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
    quiet: QuietOption = False,
) -> None:
    """Report torch, Triton, devices and each transport as probed on this machine, and the
    engine environment of each topology given."""
    opts = options(ctx, json, verbose, quiet)
    engines = [engine_report(file) for file in files or []]
    from pdctl.staging.capabilities import capabilities, report  # imports torch

    machine = report()
    settings = settings_report(dict(os.environ))
    data: DoctorReport = {
        **machine,
        "capabilities": sorted(capabilities(machine)),
        "engines": engines,
        "settings": settings,
        "unknown_variables": unknown_variables(dict(os.environ), settings),
    }
    if opts.json:
        console.emit_json(data)
        return
    out = console.out
    triton = data["triton"]
    triton_version = triton.get("version", "not importable")
    out.print(
        f"python {data['python']}, torch {data['torch']}, triton {triton_version}", markup=False
    )
    out.print(
        "devices: " + ", ".join(f"{kind} x{count}" for kind, count in data["devices"].items()),
        markup=False,
    )
    _transports(data["transports"])
    staging = data["cpu_staging"]
    how = "C row copy" if staging["native"] else f"torch index ops ({staging['detail']})"
    out.print(f"CPU staging: {how}", markup=False)
    modules = ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in data["modules"].items())
    out.print(f"modules: {modules}", markup=False)
    out.print("capabilities: " + (", ".join(data["capabilities"]) or "none"), markup=False)
    for engine in engines:
        _engine(engine)
    _settings(data["settings"], opts.verbose > 0)
    for name in data["unknown_variables"]:
        out.print(f"  {name} is set, but pdctl reads no such variable", markup=False)


def unknown_variables(environ: dict[str, str], tables: Tables) -> list[str]:
    """`PDCTL_` variables set here that no table reads (a retired switch, a typo)."""
    known = {variable_of(row["source"]) for rows in tables.values() for row in rows}
    return sorted(name for name in environ if name.startswith(PREFIX) and name not in known)


def settings_report(environ: dict[str, str]) -> Tables:
    """Every settings table (docs/settings.md), each row with the value this environment
    gives its variable, if any (a secret shown as set, never its value)."""
    from pdctl.launch.settings import ROWS as LAUNCH
    from pdctl.staging.settings import StagingSettings

    served = subprocess.run(
        [sys.executable, "-m", "pdctl.serve.settings"], capture_output=True, text=True, timeout=60
    )
    serve: list[SettingRow] = json.loads(served.stdout) if served.returncode == 0 else []
    tables: Tables = {
        "handoff": [row_json(row) for row in HANDOFF],
        "launch": [row_json(row) for row in LAUNCH],
        "serve": serve,
        "staging": [row_json(row) for row in StagingSettings.rows()],
    }
    for rows in tables.values():
        for row in rows:
            variable = variable_of(row["source"])
            if variable is not None and variable in environ:
                row["value"] = "(set)" if variable == RUN_SECRET_VAR else environ[variable]
    return tables


def _settings(tables: Tables, every_row: bool) -> None:
    out = console.out
    count = sum(len(rows) for rows in tables.values())
    out.print(f"settings: {count} rows in {len(tables)} tables (docs/settings.md)", markup=False)
    for name, rows in tables.items():
        for row in rows:
            if every_row or "value" in row:
                shown = row.get("value", row["default"] or "unset")
                out.print(f"  {name}.{row['name']} = {shown}  ({row['source']})", markup=False)


def engine_report(file: Path) -> EngineReport:
    """One topology's engine environment, as its own interpreter reports it."""
    plan = make_plan(load_checked(file))
    topology = plan.topology
    engine = get_engine(topology.engine)
    distributions, imports = engine.environment_checks(topology)
    needs = plan.requirements.engine_modules
    found = (
        probe(plan.engine_python, needs, distributions, imports)
        if distributions or imports or needs
        else EngineEnv(plan.engine_python, modules={})
    )
    return {"topology": topology.name, "engine": topology.engine, **found.to_json()}


def _engine(report: EngineReport) -> None:
    out = console.out
    head = f"engine {report['engine']} ({report['topology']}): {report['python']}"
    if report["error"]:
        out.print(f"[red]{escape(head)}: {escape(report['error'])}[/red]")
        return
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v) or "-"
    out.print(f"[green]{escape(head)}[/green] (python {report['python_version']})")
    out.print(f"  installed: {escape(versions)}")
    missing = [m for m, ok in report["modules"].items() if not ok]
    if missing:
        out.print(f"  [red]missing: {escape(', '.join(missing))}[/red]")
    for target, error in report["imports"].items():
        state = "[green]imports[/green]" if error is None else f"[red]fails: {escape(error)}[/red]"
        out.print(f"  {escape(target)}: {state}")


def _transports(found: TransportsReport) -> None:
    """A line per transport: its version, protocols or plugins, memory, and what it can do."""
    tcp, mooncake, nixl = found["tcp"], found["mooncake"], found["nixl"]
    if _available("tcp", tcp):
        bells = tcp.get("doorbells_detail", "")
        direct = tcp.get("same_host_direct", False)
        _line(
            "tcp",
            tcp.get("version"),
            _listed("protocols", tcp.get("protocols")),
            _listed("memory", tcp.get("memory_types")),
            "same-host direct writes" if direct else "TCP only",
            f"doorbells ({bells})" if tcp.get("doorbells") else f"no doorbells: {bells}",
        )
        if not direct:
            console.out.print(f"  {escape(tcp.get('detail', ''))}")
    if _available("mooncake", mooncake, mooncake.get("fix")):
        _line(
            "mooncake",
            mooncake.get("version"),
            _listed("protocols", mooncake.get("protocols")),
            _listed("memory", mooncake.get("memory_types")),
            tent_line(mooncake),
        )
        if mooncake.get("warning"):
            console.warning(f"mooncake: {mooncake['warning']}")
    if _available("nixl", nixl):
        memory = [f"{k} {', '.join(v) or 'none'}" for k, v in nixl.get("memory_types", {}).items()]
        _line(
            "nixl",
            nixl.get("version"),
            _listed("usable_plugins", nixl.get("usable_plugins")),
            "memory: " + "; ".join(memory) if memory else "",
        )


def _available(name: str, info: TransportReport, fix: str | None = None) -> bool:
    """Whether the transport imported; if not, say so (with the fix where there is one)."""
    if info.get("importable"):
        return True
    console.out.print(f"[red]{name}: not available[/red] - {escape(info.get('error', ''))}")
    if fix:
        console.out.print(f"  fix: {escape(fix)}")
    return False


def _listed(label: str, items: list[str] | None) -> str:
    return f"{label}: {', '.join(items)}" if items else ""


def _line(name: str, *parts: str | None) -> None:
    console.out.print(f"[green]{name}[/green]: " + escape("; ".join(p for p in parts if p)))
