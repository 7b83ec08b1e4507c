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
from typing import Annotated, Any

import typer
from rich.markup import escape

from pdctl import console
from pdctl.cli.common import JsonOption, QuietOption, VerboseOption, options
from pdctl.engines import get_engine
from pdctl.launch.engine_env import EngineEnv, EngineEnvJson, probe
from pdctl.launch.plan import load_checked, make_plan
from pdctl.settings import HANDOFF, PREFIX, RUN_SECRET_VAR, SettingRow, row_json

Tables = dict[str, list[SettingRow]]  # table -> its rows


class EngineReport(EngineEnvJson):
    """One topology's engine environment."""

    topology: str
    engine: str


def tent_line(info: dict[str, Any]) -> str:
    """What the Transfer Engine did when asked for TENT, as the engine showed it."""
    ran = info.get("tent_engine", {}).get("implementation", "unknown")
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

    data = report()
    data["capabilities"] = sorted(capabilities(data))
    data["engines"] = engines
    data["settings"] = settings_report(dict(os.environ))
    data["unknown_variables"] = unknown_variables(dict(os.environ), data["settings"])
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
    for name, info in data["transports"].items():
        _transport(name, info)
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
    known = {row["source"].removeprefix("env ") for rows in tables.values() for row in rows}
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
            variable = (
                row["source"].removeprefix("env ") if row["source"].startswith("env ") else None
            )
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


def _transport(name: str, info: dict[str, Any]) -> None:
    out = console.out
    if not info.get("importable"):
        out.print(f"[red]{name}: not available[/red] - {escape(str(info.get('error', '')))}")
        if info.get("fix"):
            out.print(f"  fix: {escape(info['fix'])}")
        return
    parts = [str(info.get("version") or "")]
    for key in ("protocols", "usable_plugins"):
        if info.get(key):
            parts.append(f"{key}: {', '.join(info[key])}")
    memory = info.get("memory_types")
    if isinstance(memory, dict):
        parts.append(
            "memory: " + "; ".join(f"{k} {', '.join(v) or 'none'}" for k, v in memory.items())
        )
    elif memory:
        parts.append(f"memory: {', '.join(memory)}")
    if name == "mooncake" and info.get("importable"):
        parts.append(tent_line(info))
    if name == "tcp":
        parts.append("same-host direct writes" if info.get("same_host_direct") else "TCP only")
        bells = info.get("doorbells_detail", "")
        parts.append(f"doorbells ({bells})" if info.get("doorbells") else f"no doorbells: {bells}")
    out.print(f"[green]{name}[/green]: " + escape("; ".join(p for p in parts if p)))
    if info.get("warning"):
        console.warning(f"{name}: {info['warning']}")
    if name == "tcp" and not info.get("same_host_direct"):
        out.print(f"  {escape(info.get('detail', ''))}")
