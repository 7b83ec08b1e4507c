"""The two output streams of pdctl.

`out` carries data (tables, plans, JSON) on stdout; `err` carries progress, warnings
and errors for people on stderr. Both honour NO_COLOR and never animate when the
stream is not a terminal. The verbosity level is set once by the CLI callback.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

_state = {"verbosity": 0}

out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)


def set_verbosity(level: int) -> None:
    """-1 quiet, 0 normal, 1+ verbose."""
    _state["verbosity"] = level


def verbosity() -> int:
    return _state["verbosity"]


def info(message: str) -> None:
    """Progress for people; silenced by -q."""
    if _state["verbosity"] >= 0:
        err.print(message)


def debug(message: str) -> None:
    if _state["verbosity"] >= 1:
        err.print(f"[dim]{escape(message)}[/dim]")


def warning(message: str, hint: str | None = None) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(message)}")
    if hint:
        err.print(f"  [dim]hint:[/dim] {escape(hint)}")


def error(message: str, hint: str | None = None) -> None:
    err.print(f"[red bold]error:[/red bold] {escape(message)}")
    if hint:
        err.print(f"  [dim]hint:[/dim] {escape(hint)}")


def emit_json(data: Any) -> None:
    """Write machine-readable data to stdout, nothing else on that line."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()
