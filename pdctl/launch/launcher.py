"""Where a run's processes start: the plug point between the local host and Ray.

`make_run(plan)` picks the launcher the topology names (`launcher.kind`) from a
registry and imports it lazily, so Ray is touched only by topologies that use it:
`local` is `run.Run` (this host), `ray` is `ray_run.RayRun` (the nodes of a Ray
cluster). Both offer the same run: start, readiness, reference, stop, state.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from pdctl.launch.plan import LaunchPlan
from pdctl.launch.run import Run

LAUNCHERS = {"local": "pdctl.launch.run:Run", "ray": "pdctl.launch.ray_run:RayRun"}


def make_run(plan: LaunchPlan, run_dir: Path | None = None, **options: Any) -> Run:
    """A run of `plan` on the launcher its topology names (not started yet)."""
    module, _, name = LAUNCHERS[plan.topology.launcher.kind].partition(":")
    launcher: type[Run] = getattr(importlib.import_module(module), name)
    return launcher(plan, run_dir, **options)
