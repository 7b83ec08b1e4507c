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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdctl.engines import get_engine
from pdctl.errors import LaunchError, RequirementsUnmet, UsageError
from pdctl.launch.plan import LaunchPlan, check_engine, load_checked, make_plan
from pdctl.launch.requirements import unmet
from pdctl.topology import load_text
from pdctl.topology.model import Topology, VerifySpec
from pdctl.verify.client import ServedModel, served_model
from pdctl.verify.passes import Settings
from pdctl.verify.report import EnvRecord, Report, SettingsRecord
from pdctl.verify.runner import blocking, run_passes
from pdctl.verify.targets import LaunchedTarget, RunningTarget, Target, url_target
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


def settings_of(
    options: Options, topology: Topology | None, served: ServedModel | None = None
) -> tuple[Settings, int, int]:
    """The passes' settings: flags, else the topology's verify keys, else defaults; the
    serving mode and compute dtype from the topology, else from what the servers say."""
    served = served or ServedModel()
    defaults = topology.verify if topology is not None else VerifySpec()
    count = options.num_prompts or defaults.num_prompts
    seed = options.seed if options.seed is not None else defaults.seed
    deterministic = topology.serving.deterministic if topology is not None else served.deterministic
    settings = Settings(
        max_new_tokens=options.max_new_tokens or defaults.max_new_tokens,
        concurrency=options.concurrency or defaults.concurrency,
        prefix_hit=defaults.prefix_hit,
        reference=options.reference if options.reference is not None else defaults.reference,
        serial_compare=options.serial_compare,
        near_tie=options.near_tie,
        deterministic=True if deterministic is None else deterministic,
        timeout=options.timeout
        or (topology.transfer.timeouts.request_s if topology is not None else 120.0),
        compute_dtype=topology.effective_dtype if topology is not None else served.dtype,
        engine=topology.engine if topology is not None else "embedded",
    )
    return settings, count, seed


def _env_of(plan: LaunchPlan) -> dict[str, list[EnvRecord]]:
    return {
        process.name: [
            {"name": e.name, "value": e.shown(), "source": e.source, "overrides": e.overrides}
            for e in process.env
        ]
        for process in plan.processes
    }


def _check_usage(options: Options) -> None:
    if options.url and options.running:
        raise UsageError("give --url or --running, not both")
    if options.file is not None and options.running:
        raise UsageError("a topology file is launched; --running verifies one already up")
    if options.inject and (options.url or options.file is None):
        raise UsageError(
            "faults are injected when pdctl launches the topology",
            hint="give the topology file: pdctl verify FILE --inject NAME",
        )


def verify(options: Options, progress: Callable[[str], None]) -> Report:
    """Find or launch the target, run the passes, end what was started, and report.

    Bad input raises (UsageError, TopologyError). A launch that fails or requirements
    this machine lacks end the report (verdict error or skipped) with the exception in
    `report.error`, for the caller to raise once the report is written."""
    _check_usage(options)
    loaded = load_with_faults(options.file, options.inject) if options.file else None
    plan = make_plan(loaded) if loaded is not None else None
    topology = loaded.topology if loaded is not None else None
    settings, count, seed = settings_of(options, topology)
    report = _new_report(settings, topology, count, seed)
    clock = time.perf_counter()
    target: Target | None = None
    try:
        target = _open_target(options, plan, report, progress)
        if target.mode == "launched":
            report.phases["launch_s"] = time.perf_counter() - clock
        _run(target, options, topology, report, progress)
    except (LaunchError, RequirementsUnmet) as exc:
        skipped = isinstance(exc, RequirementsUnmet)
        report.verdict = "skipped" if skipped else "error"
        report.reason = report.reason or getattr(exc, "summary", exc.message)
        report.error = exc
    finally:
        teardown = time.perf_counter()
        if target is not None:
            target.close()
        report.phases["teardown_s"] = time.perf_counter() - teardown
        report.phases["total_s"] = time.perf_counter() - clock
    return report


def _new_report(settings: Settings, topology: Topology | None, count: int, seed: int) -> Report:
    return Report(
        verdict="error",
        target={},
        settings=_settings_json(settings, topology),
        workload={"seed": seed, "count": count, "prompts": []},
        topology=topology.model_dump(mode="json") if topology is not None else None,
        started_at=time.time(),
    )


def _settings_json(settings: Settings, topology: Topology | None) -> SettingsRecord:
    return {
        "max_new_tokens": settings.max_new_tokens,
        "concurrency": settings.concurrency,
        "prefix_hit": settings.prefix_hit,
        "reference": settings.reference,
        "serial_compare": settings.serial_compare,
        "near_tie_margin": settings.near_tie,
        "near_tie_fails": settings.deterministic,
        "deterministic": settings.deterministic,
        "compute_dtype": settings.compute_dtype,
        "engine": settings.engine,
        "transfer_proof": _proof_source(settings.engine),
        "timeout_s": settings.timeout,
        "faults": [f.model_dump(exclude_none=True) for f in topology.faults] if topology else [],
    }


def _proof_source(engine: str) -> str | None:
    """Where verify reads that the KV was transferred: the engine's accounting, or (None)
    the KV digests pdctl's own servers answer with."""
    proof = get_engine(engine).proof
    return None if proof is None else proof.source


def _open_target(
    options: Options, plan: LaunchPlan | None, report: Report, progress: Callable[[str], None]
) -> Target:
    """The target, up and reachable; a launched one is started here (and stopped on error)."""
    if options.url is not None:
        target = url_target(options.url.rstrip("/"), plan)
    elif plan is None:
        target = RunningTarget(options.running)
        report.logs = target.logs()
    else:
        report.environment = _env_of(plan)
        problems = unmet(plan.requirements)
        if problems:
            report.reason = "; ".join(problems)
            raise RequirementsUnmet(
                f"{plan.topology.name} cannot run on this machine: {report.reason}"
            )
        target = LaunchedTarget(plan)
        report.target = target.describe()
        progress(f"starting {plan.topology.name} ({len(plan.processes)} processes)")
        reference = (
            options.reference if options.reference is not None else plan.topology.verify.reference
        )
        try:  # a reference asked for starts with the run: its start overlaps the launch
            target.start(options.startup_timeout, reference=reference and options.serial_compare)
        except BaseException:
            target.close()
            raise
        finally:
            report.ports = target.run.ports
            report.logs = target.logs()
        progress(f"{plan.topology.name} is up at {target.router_url}")
    report.target = target.describe()
    return target


def _run(
    target: Target,
    options: Options,
    topology: Topology | None,
    report: Report,
    progress: Callable[[str], None],
) -> None:
    """The workload sized to what the servers serve, the passes, the verdict."""
    if topology is None and target.plan is not None:  # a run of `pdctl up`: its topology
        topology = target.plan.topology
        report.topology = topology.model_dump(mode="json")
    with httpx.Client() as client:
        served = served_model(client, target.workers or [target.router_url])
    settings, count, seed = settings_of(options, topology, served)
    shape = Shape.of(topology) if topology is not None else DEFAULT_SHAPE
    if served.vocab_size is not None:  # never an id the served model does not have
        shape = replace(shape, vocab=served.vocab_size)
    if served.max_context is not None:  # nor a prompt longer than it takes
        shape = replace(shape, max_context=min(shape.max_context, served.max_context))
    prompts = build(shape, count, seed, settings.max_new_tokens)
    report.settings = _settings_json(settings, topology)
    report.workload = {
        "seed": seed,
        "count": count,
        "vocab_size": shape.vocab,
        "prompts": [p.to_json() for p in prompts],
    }
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
    if settings.reference and settings.serial_compare:
        target.start_reference_early()  # its start overlaps the passes before it
    started = time.perf_counter()
    report.passes, report.findings = run_passes(target, prompts, settings)
    report.phases["passes_s"] = time.perf_counter() - started
    report.blocking = blocking(report.findings, settings)
    report.verdict = "fail" if report.blocking else "pass"
    report.logs = target.logs() or report.logs
