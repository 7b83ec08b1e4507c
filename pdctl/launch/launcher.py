"""How commands make a run: `make_run(plan)`, on the host its topology names.

Where processes start is the run's host (`hosts.py`: this host, or the nodes of a Ray
cluster, picked by `launcher.kind` and imported lazily); the run is the same on both:
start, readiness, reference, stop, state.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pdctl.launch.plan import LaunchPlan
from pdctl.launch.run import Run


def make_run(
    plan: LaunchPlan,
    run_dir: Path | None = None,
    *,
    detach: bool = False,
    parent_env: Mapping[str, str] | None = None,
) -> Run:
    """A run of `plan` on the launcher its topology names (not started yet)."""
    return Run(plan, run_dir, detach=detach, parent_env=parent_env)
