"""A process's way up, and the one error a launch fails with.

    starting (spawned) -> alive (still running) -> healthy -> ready

`ProcessState` is plain state the run and its readiness checks move forward (never
back); `LaunchFailed` names the process and carries the log tails that explain it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdctl.errors import LaunchError
from pdctl.launch.plan import ProcessPlan
from pdctl.launch.processes import Spawned

STAGES = ("starting", "alive", "healthy", "ready")


REFERENCE_ROLE = "colocated"  # the role of a run's colocated reference server


class LaunchFailed(LaunchError):
    """The run could not come up; `report` says which process and why (with its log)."""

    def __init__(self, message: str, report: str = "") -> None:
        super().__init__(message + (f"\n{report}" if report else ""))
        self.summary = message
        self.report = report


@dataclass
class ProcessState:
    plan: ProcessPlan
    url: str
    spawned: Spawned | None = None
    stage: str = "starting"
    since: float = field(default_factory=time.monotonic)
    detail: str = ""

    def advance(self, stage: str, detail: str = "") -> bool:
        self.detail = detail
        if STAGES.index(stage) > STAGES.index(self.stage):
            self.stage, self.since = stage, time.monotonic()
            return True
        return False
