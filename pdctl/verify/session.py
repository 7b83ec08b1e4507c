"""One `pdctl verify`: find or launch the target, run the passes, tear down, report.

Targets: a topology file (launched by pdctl, with any `--inject`ed faults, and torn
down afterwards), a run `pdctl up` started (`--running NAME`, or the only one up),
or `--url URL` (any PD router with the same API; a topology file given with it only
shapes the workload and the reference, it is not launched). Only what this command
started is ever stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdctl.errors import LaunchError, RequirementsUnmet, UsageError
from pdctl.launch import state
from pdctl.launch.plan import LaunchPlan, check_engine, load_checked, make_plan
from pdctl.launch.requirements import unmet
from pdctl.launch.run import Run
from pdctl.topology import load_text
from pdctl.topology.model import Topology
from pdctl.verify.report import Report
from pdctl.verify.runner import Settings, Target, blocking, run_passes
from pdctl.verify.workload import Shape, build

DEFAULT_SHAPE = Shape(page=16, chunk=512, segment=256, ring=1024, max_context=4096, vocab=512)


@dataclass
class Options:
    file: Path | None = None
    running: str | None = None
    url: str | None = None
    inject: list[str] = field(default_factory=list)
    num_prompts: int | None = None
    max_new_tokens: int | None = None
    concurrency: int | None = None
    seed: int | None = None
    reference: bool | None = None
    serial_compare: bool = True
    near_tie: float = 0.05
    timeout: float | None = None
    startup_timeout: float | None = None


def parse_fault(spec: str) -> dict[str, Any]:
    """`NAME[:KEY=VALUE,...]`, e.g. `corrupt-kv:every=2`, `kill-role:role=decode,after=3`."""
    name, _, rest = spec.partition(":")
    fault: dict[str, Any] = {"name": name.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(
                f"--inject {spec}: {item!r} is not KEY=VALUE",
                hint="e.g. --inject corrupt-kv:every=2 or --inject kill-role:role=decode,after=3",
            )
        fault[key.strip()] = yaml.safe_load(value)
    return fault


def load_with_faults(file: Path, inject: list[str]) -> Any:
    """The topology file, with `--inject`ed faults added and validated like any key."""
    if not inject:
        return load_checked(file)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return load_checked(file)  # let the loader report the problem with its location
    if not isinstance(data, dict):
        return load_checked(file)
    data["faults"] = [*(data.get("faults") or []), *(parse_fault(s) for s in inject)]
    text = yaml.safe_dump(data, sort_keys=False)
    return check_engine(load_text(text, f"{file} (with --inject)", base_dir=file.parent))


def settings_of(options: Options, topology: Topology | None) -> tuple[Settings, int, int]:
    defaults = topology.verify if topology is not None else None
    count = options.num_prompts or (defaults.num_prompts if defaults else 12)
    seed = options.seed if options.seed is not None else (defaults.seed if defaults else 0)
    settings = Settings(
        max_new_tokens=options.max_new_tokens or (defaults.max_new_tokens if defaults else 16),
        concurrency=options.concurrency or (defaults.concurrency if defaults else 8),
        prefix_hit=defaults.prefix_hit if defaults else True,
        reference=options.reference
        if options.reference is not None
        else (defaults.reference if defaults else False),
        serial_compare=options.serial_compare,
        near_tie=options.near_tie,
        strict_near_tie=topology is None or topology.engine == "embedded",
        timeout=options.timeout
        or (topology.transfer.timeouts.request_s if topology is not None else 120.0),
    )
    return settings, count, seed


def _env_of(plan: LaunchPlan) -> dict[str, list[dict[str, Any]]]:
    return {
        process.name: [
            {"name": e.name, "value": e.shown(), "source": e.source, "overrides": e.overrides}
            for e in process.env
        ]
        for process in plan.processes
    }


def verify(options: Options, progress: Callable[[str], None]) -> Report:
    modes = [m for m, given in (("url", options.url), ("running", options.running)) if given]
    if len(modes) > 1:
        raise UsageError("give --url or --running, not both")
    if options.file is not None and options.running:
        raise UsageError("a topology file is launched; --running verifies one already up")
    if options.inject and (options.url or options.file is None):
        raise UsageError(
            "faults are injected when pdctl launches the topology",
            hint="give the topology file: pdctl verify FILE --inject NAME",
        )
    started = time.time()
    clock = time.perf_counter()
    phases: dict[str, float] = {}
    cleanups: list[Callable[[], Any]] = []
    loaded = None
    plan: LaunchPlan | None = None
    if options.file is not None:
        loaded = load_with_faults(options.file, options.inject)
        plan = make_plan(loaded)
    topology = loaded.topology if loaded is not None else None
    settings, count, seed = settings_of(options, topology)
    prompts = build(
        Shape.of(topology) if topology is not None else DEFAULT_SHAPE,
        count,
        seed,
        settings.max_new_tokens,
    )
    report = Report(
        verdict="error",
        target={},
        settings={
            "max_new_tokens": settings.max_new_tokens,
            "concurrency": settings.concurrency,
            "prefix_hit": settings.prefix_hit,
            "reference": settings.reference,
            "serial_compare": settings.serial_compare,
            "near_tie_margin": settings.near_tie,
            "near_tie_fails": settings.strict_near_tie,
            "timeout_s": settings.timeout,
            "faults": [f.model_dump(exclude_none=True) for f in topology.faults]
            if topology
            else [],
        },
        workload={"seed": seed, "count": count, "prompts": [p.to_json() for p in prompts]},
        topology=topology.model_dump(mode="json") if topology is not None else None,
        started_at=started,
    )
    run: Run | None = None
    try:
        if options.url is not None:
            target = _url_target(options.url.rstrip("/"))
            report.target = {"mode": "url", "router_url": target.router_url}
        elif options.file is None:
            target, run_state = _running_target(options.running)
            report.target = {
                "mode": "running",
                "run": run_state.name,
                "topology": run_state.topology,
                "router_url": target.router_url,
            }
            report.logs = _logs_of(run_state.data)
        else:
            assert plan is not None and topology is not None
            report.target = {
                "mode": "launched",
                "topology": topology.name,
                "file": str(options.file),
            }
            report.environment = _env_of(plan)
            problems = unmet(plan.requirements)
            if problems:
                report.verdict, report.reason = "skipped", "; ".join(problems)
                raise RequirementsUnmet(
                    f"{topology.name} cannot run on this machine: {report.reason}"
                )
            run = Run(plan)
            cleanups.append(run.stop)
            progress(f"starting {topology.name} ({len(plan.processes)} processes)")
            run.start()
            report.ports = run.ports
            report.logs = {s.plan.name: str(s.spawned.log_path) for s in run.states if s.spawned}
            run.wait_ready(options.startup_timeout)
            phases["launch_s"] = time.perf_counter() - clock
            progress(f"{topology.name} is up at {run.router_url}")
            target = _launched_target(run)
            report.target["router_url"] = target.router_url
        if target.start_reference is None and topology is not None and run is None:
            target.start_reference = _reference_from(topology, loaded, cleanups)
        passes_started = time.perf_counter()
        progress(
            f"{count} prompts, {settings.max_new_tokens} new tokens each, concurrency "
            f"{settings.concurrency}: "
            + (
                "serial, serial again, concurrent, prefix hit"
                + (", reference" if settings.reference else "")
                if settings.serial_compare
                else "one concurrent pass"
            )
        )
        report.passes, report.findings = run_passes(target, prompts, settings)
        phases["passes_s"] = time.perf_counter() - passes_started
        report.blocking = blocking(report.findings, settings)
        report.verdict = "fail" if report.blocking else "pass"
        if run is not None:
            report.logs.update(
                {s.plan.name: str(s.spawned.log_path) for s in run.states if s.spawned}
            )
    except LaunchError as exc:
        report.verdict = "error"
        report.reason = getattr(exc, "summary", str(exc))
        raise
    except RequirementsUnmet:
        raise
    finally:
        teardown = time.perf_counter()
        for cleanup in reversed(cleanups):
            cleanup()
        phases["teardown_s"] = time.perf_counter() - teardown
        phases["total_s"] = time.perf_counter() - clock
        report.phases = phases
        _last_report[0] = report
    return report


_last_report: list[Report | None] = [None]  # the report of a verify that raised (for --json)


def last_report() -> Report | None:
    return _last_report[0]


def _launched_target(run: Run) -> Target:
    urls = {
        role: [s.url for s in run.states if s.plan.role == role] for role in ("prefill", "decode")
    }
    return Target(
        "launched",
        run.router_url,
        urls["prefill"],
        urls["decode"],
        check_alive=run.check_exits,
        start_reference=lambda: run.start_reference(tp=1),
    )


def _running_target(name: str | None) -> tuple[Target, state.RunState]:
    live = [r for r in state.select(name) if not r.stale]
    if not live:
        what = f"no run named {name!r} is up" if name else "no topology is up on this host"
        raise UsageError(what, hint="give a topology file, or start one with `pdctl up FILE`")
    if len(live) > 1:
        raise UsageError(
            f"{len(live)} runs are up: {', '.join(r.name for r in live)}",
            hint="pick one with --running NAME",
        )
    (run_state,) = live
    urls = {
        role: [p["url"] for p in run_state.processes if p["role"] == role]
        for role in ("prefill", "decode")
    }

    def check_alive() -> None:
        for process in run_state.processes:
            if not run_state.alive(process):
                raise LaunchError(
                    f"{process['name']} ({process['role']}, pid {process['pid']}) is not running "
                    "any more"
                )

    return (
        Target(
            "running",
            str(run_state.data["router_url"]),
            urls["prefill"],
            urls["decode"],
            check_alive=check_alive,
        ),
        run_state,
    )


def _url_target(url: str) -> Target:
    """Any router: the builtin one lists its workers, so their caches can be flushed."""
    prefill: list[str] = []
    decode: list[str] = []
    try:
        info = httpx.get(f"{url}/get_server_info", timeout=10).json()
        prefill = [w["url"] for w in info.get("prefill", []) if isinstance(w, dict)]
        decode = [w["url"] for w in info.get("decode", []) if isinstance(w, dict)]
    except (httpx.HTTPError, ValueError, AttributeError, KeyError):
        pass
    if not prefill and not decode:
        prefill = [url]  # other routers: /flush_cache on the router flushes its workers
    return Target("url", url, prefill, decode)


def _reference_from(
    topology: Topology, loaded: Any, cleanups: list[Callable[[], Any]]
) -> Callable[[], str]:
    def start() -> str:
        run = Run(make_plan(loaded))
        cleanups.append(run.stop)
        return run.start_reference(tp=1)

    return start


def _logs_of(data: dict[str, Any]) -> dict[str, str]:
    return {p["name"]: p["log"] for p in data.get("processes", []) if p.get("log")}
