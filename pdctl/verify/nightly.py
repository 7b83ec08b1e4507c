"""`pdctl nightly`: verify a suite of topologies one after another, skipping cleanly.

Topologies are collected from files and directories, selected by suite tag, and
checked against this machine (devices and their free memory, modules, capabilities
from `pdctl doctor`). What cannot run is skipped with the precise reason; the rest
is verified (launch, passes, teardown) in turn. One JUnit file (a testsuite per
topology) and one JSON summary come out. The nightly fails only on a real failure:
a finding, a launch that failed, or an invalid topology file; a selection with no
topology at all is a usage error (exit 2), never a pass.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from pdctl.errors import PdctlError, RequirementsUnmet, UsageError
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.requirements import machine, unmet
from pdctl.topology.issues import TopologyError
from pdctl.verify import session
from pdctl.verify.report import Report, VerifyJson


class OutcomeJson(TypedDict):
    """One topology of the suite as the nightly's JSON gives it."""

    file: str
    name: str
    verdict: str
    reason: str | None
    seconds: float
    findings: int  # blocking ones
    report: VerifyJson | None


class SuiteMachine(TypedDict):
    """What the machine had, where a topology was skipped for it (else both None)."""

    devices: dict[str, int] | None
    capabilities: list[str] | None


class NightlyJson(TypedDict):
    """`pdctl nightly --json`: the suite's verdict, its counts, every topology."""

    suite: str | None
    verdict: str
    counts: dict[str, int]  # verdict -> topologies
    machine: SuiteMachine
    topologies: list[OutcomeJson]


@dataclass
class Outcome:
    file: Path
    name: str
    verdict: str  # pass | fail | error | skipped | invalid
    reason: str | None = None
    seconds: float = 0.0
    report: Report | None = None

    @property
    def failed(self) -> bool:
        return self.verdict in ("fail", "error", "invalid")

    def to_json(self) -> OutcomeJson:
        return {
            "file": str(self.file),
            "name": self.name,
            "verdict": self.verdict,
            "reason": self.reason,
            "seconds": round(self.seconds, 2),
            "findings": len(self.report.blocking) if self.report else 0,
            "report": self.report.to_json() if self.report else None,
        }


def collect(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        elif path.exists():
            files.append(path)
        else:
            raise UsageError(f"{path}: no such file or directory")
    return files


def _invalid(file: Path, error: TopologyError) -> Outcome:
    first = error.issues[0].headline() if error.issues else str(error)
    more = f" (and {len(error.issues) - 1} more)" if len(error.issues) > 1 else ""
    return Outcome(file, file.stem, "invalid", first + more)


def run_nightly(
    paths: list[Path],
    suite: str | None,
    *,
    fail_fast: bool = False,
    progress: Callable[[str], None] = lambda _: None,
    overrides: session.Options | None = None,
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    found: set[str] = set()  # every suite tag seen, for the hint of an empty selection
    for file in collect(paths):
        try:
            loaded = load_checked(file)
        except TopologyError as error:
            outcomes.append(_invalid(file, error))
            progress(f"{file}: invalid: {outcomes[-1].reason}")
            if fail_fast:
                break
            continue
        topology = loaded.topology
        found.update(topology.suites)
        if suite is not None and suite not in topology.suites:
            continue
        problems = unmet(make_plan(loaded).requirements)
        if problems:
            reason = "; ".join(problems)
            outcomes.append(
                Outcome(
                    file,
                    topology.name,
                    "skipped",
                    reason,
                    report=_skipped_report(topology.name, str(file), reason),
                )
            )
            progress(f"{topology.name}: skipped: {reason}")
            continue
        progress(f"{topology.name}: verifying")
        options = session.Options(**{**vars(overrides or session.Options()), "file": file})
        started = time.perf_counter()
        try:
            report = session.verify(options, lambda message: progress(f"  {message}"))
        except PdctlError as exc:  # bad input met only now (an --inject'ed fault, say)
            report = _skipped_report(topology.name, str(file), exc.message.splitlines()[0])
            report.verdict, report.error = "error", exc
        outcome = _outcome(file, topology.name, report)
        outcome.seconds = time.perf_counter() - started
        outcomes.append(outcome)
        progress(
            f"{topology.name}: {outcome.verdict} in {outcome.seconds:.1f} s"
            + (f" ({outcome.reason})" if outcome.reason else "")
        )
        if fail_fast and outcome.failed:
            break
    if not outcomes:  # nothing passes by absence
        where = ", ".join(str(p) for p in paths)
        raise UsageError(
            f"no topology in {where} " + (f"is tagged {suite!r}" if suite else "was found"),
            hint=f"suites found: {', '.join(sorted(found))}"
            if found
            else "give a folder or files of topologies (*.yaml)",
        )
    return outcomes


def _outcome(file: Path, name: str, report: Report) -> Outcome:
    if isinstance(report.error, RequirementsUnmet):
        return Outcome(file, name, "skipped", report.error.message, report=report)
    if report.error is not None:
        return Outcome(file, name, "error", report.error.message.splitlines()[0], report=report)
    outcome = Outcome(file, name, report.verdict, None, report=report)
    if report.verdict == "fail":
        kinds = ", ".join(sorted({f.classification for f in report.blocking}))
        outcome.reason = f"{len(report.blocking)} finding(s): {kinds}"
    return outcome


def _skipped_report(name: str, file: str, reason: str) -> Report:
    return Report(
        verdict="skipped",
        reason=reason,
        target={"mode": "launched", "topology": name, "file": file},
        settings={},
        workload={},
        started_at=time.time(),
    )


def junit(outcomes: list[Outcome], suite: str | None) -> ET.Element:
    root = ET.Element("testsuites", name=f"pdctl nightly {suite or 'all'}")
    for outcome in outcomes:
        if outcome.report is not None:
            element = outcome.report.junit()
            if outcome.verdict == "error" and not outcome.report.passes:
                for error in element.iter("error"):
                    error.set("message", outcome.reason or "launch failed")
            root.append(element)
            continue
        element = ET.SubElement(
            root,
            "testsuite",
            name=f"pdctl verify {outcome.name}",
            tests="1",
            failures="0",
            errors="1",
            skipped="0",
        )
        case = ET.SubElement(
            element, "testcase", classname=f"pdctl.verify.{outcome.name}", name="load"
        )
        ET.SubElement(case, "error", message=f"invalid topology: {outcome.reason}")
    return root


def write_junit(outcomes: list[Outcome], suite: str | None, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    root = junit(outcomes, suite)
    ET.indent(root)
    path.write_bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))


def summary(outcomes: list[Outcome], suite: str | None) -> NightlyJson:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
    found = machine() if any(o.verdict == "skipped" for o in outcomes) else {}
    return {
        "suite": suite,
        "verdict": "fail" if any(o.failed for o in outcomes) else "pass",
        "counts": counts,
        "machine": {
            "devices": found.get("devices"),
            "capabilities": found.get("capabilities"),
        },
        "topologies": [o.to_json() for o in outcomes],
    }
