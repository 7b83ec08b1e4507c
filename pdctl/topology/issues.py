"""Diagnostics about a topology file: what is wrong, where, and how to fix it.

An `Issue` names a key path (`roles.decode.tp`) and, once located against the YAML
source, a line and column. Rendering follows the compiler convention
`file:line:column: key.path: message`, followed by an optional `hint:` line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pdctl.errors import UsageError

KeyPath = tuple[str | int, ...]
Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class RuleContext:
    """What a rule is given besides the topology."""

    base_dir: Path  # directory of the topology file: relative paths start here


def dotted(path: KeyPath) -> str:
    """`("roles", "decode", "devices", 1)` -> `roles.decode.devices[1]`."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


@dataclass(frozen=True)
class Issue:
    path: KeyPath
    message: str
    hint: str | None = None
    severity: Severity = "error"
    at_key: bool = False  # locate the key itself rather than its value
    file: str | None = None
    line: int | None = None
    column: int | None = None

    @property
    def key(self) -> str:
        return dotted(self.path)

    def at(self, file: str, line: int | None, column: int | None) -> Issue:
        return replace(self, file=file, line=line, column=column)

    def location(self) -> str:
        parts = [self.file or "<topology>"]
        if self.line is not None:
            parts += [str(self.line), str(self.column or 1)]
        return ":".join(parts)

    def headline(self) -> str:
        """The one-line diagnostic, without the hint."""
        prefix = "" if self.severity == "error" else "warning: "
        where = f"{self.key}: " if self.path else ""
        return f"{self.location()}: {prefix}{where}{self.message}"

    def to_json(self) -> dict[str, object]:
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "key": self.key,
            "severity": self.severity,
            "message": self.message,
            "hint": self.hint,
        }


def errors_only(issues: Iterable[Issue]) -> list[Issue]:
    return [issue for issue in issues if issue.severity == "error"]


class TopologyError(UsageError):
    """A topology file that cannot be used; carries every issue found, not just the first."""

    def __init__(self, issues: Sequence[Issue]) -> None:
        first = issues[0]
        more = f" (and {len(issues) - 1} more)" if len(issues) > 1 else ""
        super().__init__(first.headline() + more, first.hint)
        self.issues = list(issues)
