"""Load a topology: file -> text -> YAML with positions -> typed model -> rules.

`load_file` is the one way into a `Topology`. Every problem becomes a located
`Issue`; all errors are collected and raised together as a `TopologyError`, and
warnings come back with the result. Nothing here prints or exits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from pdctl.topology.issues import Issue, RuleContext, TopologyError, errors_only
from pdctl.topology.messages import translate_all
from pdctl.topology.model import Topology
from pdctl.topology.rules import run_rules
from pdctl.topology.source import SourceMap, SourceProblem, decode_text, kind_of, parse

MAX_FILE_BYTES = 1 << 20  # a topology is a few KB; refuse to parse anything huge


@dataclass(frozen=True)
class LoadedTopology:
    topology: Topology
    file: str
    source: SourceMap
    base_dir: Path
    warnings: tuple[Issue, ...]

    def locate(self, issue: Issue) -> Issue:
        """Attach this file's position of the issue's key path."""
        return _locate(issue, self.file, self.source)

    @property
    def context(self) -> RuleContext:
        return RuleContext(self.base_dir)


def _locate(issue: Issue, file: str, source: SourceMap) -> Issue:
    if issue.line is not None:
        return issue.at(file, issue.line, issue.column)
    position = source.locate(issue.path, prefer_key=issue.at_key)
    return issue.at(file, position.line, position.column)


def _file_issue(file: str, message: str, hint: str | None = None) -> TopologyError:
    return TopologyError([Issue((), message, hint, file=file)])


def load_text(text: str, file: str = "<topology>", base_dir: Path | None = None) -> LoadedTopology:
    """Validate topology text; raise TopologyError with every issue found."""
    try:
        data, source = parse(text)
    except SourceProblem as problem:
        raise TopologyError(
            [problem.issue.at(file, problem.issue.line, problem.issue.column)]
        ) from None
    if not isinstance(data, dict):
        raise TopologyError(
            [
                Issue(
                    (),
                    f"the top level must be a mapping of keys (name, roles, ...), "
                    f"not {kind_of(data)}",
                    "see `pdctl schema` or copy a file from topologies/",
                ).at(file, 1, 1)
            ]
        )
    try:
        topology = Topology.model_validate(data)
    except ValidationError as exc:
        issues = [_locate(issue, file, source) for issue in translate_all(exc)]
        raise TopologyError(_sorted(issues)) from None
    context = RuleContext(base_dir or Path.cwd())
    issues = _sorted([_locate(issue, file, source) for issue in run_rules(topology, context)])
    if errors_only(issues):
        raise TopologyError(issues)
    topology = _with_engine_python(topology, context)
    return LoadedTopology(topology, file, source, context.base_dir, tuple(issues))


def _with_engine_python(topology: Topology, context: RuleContext) -> Topology:
    """engine_python made absolute when it is a path (it holds a '/'): relative to the
    topology file's folder, as model.path. A bare name stays a command looked up on PATH."""
    written = topology.engine_python
    if written is None or "/" not in written:
        return topology
    path = os.path.normpath(context.base_dir / Path(written).expanduser())  # links kept: a
    return topology.model_copy(update={"engine_python": path})  # venv's python is one


def _sorted(issues: list[Issue]) -> list[Issue]:
    return sorted(issues, key=lambda issue: (issue.line or 0, issue.column or 0))


def load_file(path: str | Path) -> LoadedTopology:
    """Read and validate a topology file; raise TopologyError naming the file."""
    file = str(path)
    target = Path(path)
    if target.is_dir():
        raise _file_issue(file, "is a directory", f"pass the files inside it: {file}/*.yaml")
    try:
        with target.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise _file_issue(file, "no such file") from None
    except PermissionError:
        raise _file_issue(file, "permission denied") from None
    except OSError as exc:
        raise _file_issue(file, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise _file_issue(file, f"is larger than {MAX_FILE_BYTES // 1024} KiB; not a topology")
    try:
        text = decode_text(data)
    except SourceProblem as problem:
        raise TopologyError(
            [problem.issue.at(file, problem.issue.line, problem.issue.column)]
        ) from None
    return load_text(text, file, target.resolve().parent)
