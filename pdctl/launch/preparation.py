"""What a run does before its first server starts: the engine's preparations, each
process's folder.

A preparation (`engines.base.Preparation`, the preset written as a checkpoint for
vLLM) runs in pdctl's interpreter, bounded, unless its marker file already says it
was done; a failure is a LaunchFailed with the step's output. A process whose
engine asks for a folder of its own (`ProcessPlan.workdir`) gets it with `tmp`
inside: vLLM's caches, sockets and temporary files stay in the run directory.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

from pdctl.engines.base import Preparation
from pdctl.launch.stages import LaunchFailed

TIMEOUT_S = 600.0


def done(step: Preparation) -> bool:
    try:
        return Path(step.marker).read_text(encoding="utf-8") == step.marker_text
    except OSError:
        return False


def prepare(steps: Iterable[Preparation]) -> None:
    """Run each step not done yet; LaunchFailed naming the step when one fails."""
    for step in steps:
        if done(step):
            continue
        try:
            result = subprocess.run(
                list(step.argv), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchFailed(f"could not prepare {step.what}: {exc}") from None
        if result.returncode != 0 or not done(step):
            output = (result.stderr or result.stdout).strip().splitlines()[-20:]
            raise LaunchFailed(
                f"could not prepare {step.what} (exit {result.returncode})", "\n".join(output)
            )


def make_workdir(folder: Path) -> Path:
    """A process's own folder of the run, with the `tmp` its sockets and files go in."""
    (folder / "tmp").mkdir(parents=True, exist_ok=True)
    return folder
