"""The settings vocabulary: a typed row per tunable, and the variables pdctl hands its servers.

Every tunable of pdctl is a row in one table per package (`launch/settings.py`,
`serve/settings.py`, `staging/settings.py`; staging keeps its own row type, it imports
nothing else from pdctl): a name, a default, the reason it exists, and where a value
comes from (a flag of the process, a topology key, or, for a host path or the launcher's
hand-off, one `PDCTL_` environment variable). Each table is parsed once at its
process's edge and passed in through constructors; `pdctl doctor` shows every table and
docs/settings.md is generated from them (`python -m pdctl.settings`). A `PDCTL_`
variable read anywhere but a settings table fails tests/test_architecture.py.

`HANDOFF` is the launcher's side of the contract with the processes it starts: it sets
these variables and the servers read them at their edge (`serve/settings.py`). They are
not tunables: a user never sets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypedDict


@dataclass(frozen=True)
class Setting:
    """One row of a settings table."""

    name: str  # the field (or the variable, for a hand-off row)
    default: str  # as a user would write it; "" for none
    reason: str  # why it exists: what it changes, what was measured
    source: str  # where a value comes from: "--flag", "topology: key", or "env PDCTL_..."

    @property
    def variable(self) -> str | None:
        """The environment variable of an `env PDCTL_...` row, else None."""
        return variable_of(self.source)


def variable_of(source: str) -> str | None:
    """The environment variable a row's source names (`env PDCTL_...`), else None."""
    return source.removeprefix("env ") if source.startswith("env ") else None


class TableRow(Protocol):
    """A row of any package's table (staging keeps its own `Row`, of this shape)."""

    @property
    def name(self) -> str: ...
    @property
    def default(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def source(self) -> str: ...


class _SettingRow(TypedDict):
    name: str
    default: str
    reason: str
    source: str


class SettingRow(_SettingRow, total=False):
    """A row as `pdctl doctor` reports it: `value` where this environment sets it."""

    value: str


def row_json(row: TableRow) -> SettingRow:
    return {"name": row.name, "default": row.default, "reason": row.reason, "source": row.source}


PREFIX = "PDCTL_"  # pdctl's own variables: a topology's env may set none of them
# Variables that earlier pdctl read, now topology keys: a topology that sets one is told
# which key says it now.
RETIRED: dict[str, str] = {"PDCTL_TRITON_MATMUL": "serving.deterministic"}

RUN_ID_VAR = "PDCTL_RUN_ID"
RUN_SECRET_VAR = "PDCTL_RUN_SECRET"
FAULTS_VAR = "PDCTL_FAULTS"
LOG_DIR_VAR = "PDCTL_LOG_DIR"
PROCESS_NAME_VAR = "PDCTL_PROCESS_NAME"

HANDOFF: tuple[Setting, ...] = (
    Setting(
        RUN_ID_VAR,
        "",
        "which run a process belongs to: `pdctl down` and `status` find a "
        "run's processes by it, never by name",
        f"env {RUN_ID_VAR}",
    ),
    Setting(
        RUN_SECRET_VAR,
        "",
        "the per-run secret the bootstrap, internal and peer endpoints "
        "check; kept off every command line",
        f"env {RUN_SECRET_VAR}",
    ),
    Setting(
        FAULTS_VAR,
        "",
        "the faults a topology injects into a role (JSON list); off unless "
        "the topology has `faults:`",
        f"env {FAULTS_VAR}",
    ),
    Setting(
        LOG_DIR_VAR,
        "",
        "the run directory: a server's TP ranks write their own logs there",
        f"env {LOG_DIR_VAR}",
    ),
    Setting(
        PROCESS_NAME_VAR,
        "",
        "the process's name in the plan: names its ranks' logs",
        f"env {PROCESS_NAME_VAR}",
    ),
)


def markdown(title: str, rows: Iterable[Setting]) -> str:
    """A settings table as the Markdown docs/settings.md holds."""
    lines = [f"## {title}", "", "| setting | default | set by | why |", "|---|---|---|---|"]
    for row in rows:
        default = f"`{row.default}`" if row.default else ""
        lines.append(f"| `{row.name}` | {default} | `{row.source}` | {row.reason} |")
    return "\n".join([*lines, ""])
