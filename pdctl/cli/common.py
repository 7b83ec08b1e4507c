"""Options shared by every command and the one place errors become exit codes.

Global flags may be given before the command (`pdctl --json plan f.yaml`) or after
it (`pdctl plan f.yaml --json`); both land in one `Options` object.
"""

from __future__ import annotations

import os
import select
import sys
import traceback
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from pdctl import console
from pdctl.errors import ExitCode, PdctlError
from pdctl.topology.issues import TopologyError


@dataclass
class Options:
    json: bool = False
    verbose: int = 0
    quiet: bool = False


JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
VerboseOption = Annotated[
    int, typer.Option("--verbose", "-v", count=True, help="More detail; tracebacks on errors.")
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="Only errors and data.")]


def options(
    ctx: typer.Context, json: bool = False, verbose: int = 0, quiet: bool = False
) -> Options:
    """Merge a command's own flags into the global ones and apply verbosity."""
    root = ctx.find_root()
    merged: Options = root.obj if isinstance(root.obj, Options) else Options()
    merged.json = merged.json or json
    merged.verbose = max(merged.verbose, verbose)
    merged.quiet = merged.quiet or quiet
    console.set_verbosity(-1 if merged.quiet else merged.verbose)
    root.obj = merged
    return merged


def report_issues(error: TopologyError) -> None:
    for issue in error.issues:
        style = "red" if issue.severity == "error" else "yellow"
        console.err.print(f"[{style}]{issue.location()}:[/{style}] ", end="")
        rest = issue.headline().removeprefix(issue.location() + ": ")
        console.err.print(rest, markup=False)
        if issue.hint:
            console.err.print(f"  hint: {issue.hint}", markup=False)


class PdctlGroup(TyperGroup):
    """Maps every PdctlError to its exit code; tracebacks only with -v."""

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except TopologyError as exc:
            report_issues(exc)
            raise typer.Exit(exc.exit_code) from None
        except PdctlError as exc:
            _maybe_traceback(ctx)
            console.error(exc.message, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            console.error("interrupted")
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except Exception as exc:
            if isinstance(exc, BrokenPipeError) and _reader_gone():
                raise typer.Exit(ExitCode.OUTPUT_CLOSED) from None  # no one left to tell
            _maybe_traceback(ctx)
            console.error(
                f"internal error: {type(exc).__name__}: {exc}",
                "this is a bug in pdctl; run again with -v for the traceback and report it",
            )
            raise typer.Exit(ExitCode.INTERNAL) from None


def _reader_gone() -> bool:
    """Whether stdout's reader went away (a pipe or socket closed at the far end: `pdctl
    ... | head`), as opposed to a broken pipe of pdctl's own (a server's socket). If so,
    stdout is pointed at /dev/null, so the interpreter's last flush has nowhere to fail."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
        return False
    poller = select.poll()
    poller.register(descriptor, select.POLLOUT)
    if not any(mask & (select.POLLERR | select.POLLHUP) for _, mask in poller.poll(0)):
        return False
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, descriptor)
    os.close(null)
    return True


def _maybe_traceback(ctx: typer.Context) -> None:
    obj = ctx.find_root().obj
    if isinstance(obj, Options) and obj.verbose:
        console.err.print(traceback.format_exc(), markup=False)
