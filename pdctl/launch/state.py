"""Run state on this host: what `pdctl up` started, for `status`, `logs` and `down`.

Every run writes `<state dir>/runs/<run name>.json` (and `run.json` in its run
directory) with each process's PID, process group and start time. A PID is only
trusted together with its start time, so a state file left by a crashed run can
never make pdctl signal an unrelated process that reused the PID. A run whose
processes are all gone is stale: `status` reports it and removes the file.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdctl.launch.ports import state_dir
from pdctl.launch.processes import group_members, pid_alive, stop_groups
from pdctl.launch.run_record import ProcessRecord, RunRecord


def runs_dir() -> Path:
    return state_dir() / "runs"


@dataclass
class RunState:
    data: dict[str, Any]  # the record as read from its file (`RunRecord` when pdctl wrote it)
    path: Path

    @property
    def name(self) -> str:
        return str(self.data["name"])

    @property
    def topology(self) -> str:
        return str(self.data["topology"])

    @property
    def processes(self) -> list[ProcessRecord]:
        return list(self.data["processes"])

    @property
    def on_ray(self) -> bool:
        """Started by `launcher: ray`: its processes are asked through their Ray actors."""
        return self.data.get("launcher") == "ray"

    def alive(self, process: ProcessRecord) -> bool:
        if self.on_ray:
            from pdctl.launch.ray_launcher import recorded_alive

            return recorded_alive({**self.data, "processes": [process]}).get(process["name"], False)
        pid = process.get("pid")
        return pid is not None and pid_alive(int(pid), process.get("start_time"))

    def live_processes(self) -> list[ProcessRecord]:
        if self.on_ray:
            from pdctl.launch.ray_launcher import recorded_alive

            alive = recorded_alive(self.data)
            return [p for p in self.processes if alive.get(p["name"])]
        return [p for p in self.processes if self.alive(p)]

    @property
    def stale(self) -> bool:
        """Nothing of the run is running any more (crashed, killed, or ended uncleanly)."""
        return not self.live_processes()

    def health(self, timeout: float = 2.0) -> dict[str, str]:
        """Process name -> 'healthy' | 'unhealthy (...)' | 'dead'."""
        found = {}
        with httpx.Client(timeout=timeout) as client:
            for process in self.processes:
                if not self.alive(process):
                    found[process["name"]] = "dead"
                    continue
                try:
                    code = client.get(f"{process['url']}/health").status_code
                    found[process["name"]] = "healthy" if code == 200 else f"unhealthy ({code})"
                except httpx.HTTPError as exc:
                    found[process["name"]] = f"unhealthy ({type(exc).__name__})"
        return found

    def stop(self, grace: float = 5.0) -> tuple[int, list[int]]:
        """End every live process group of the run (only processes whose PID and start
        time match the record); (groups ended, PIDs of those groups still alive after)."""
        if self.on_ray:
            from pdctl.launch.ray_launcher import stop_recorded

            left = stop_recorded(self.data, grace)
            pids = [p["pid"] for p in self.processes if p["name"] in left and p["pid"] is not None]
            return len(self.processes), pids
        pgids = [p["pgid"] for p in self.live_processes() if p["pgid"] is not None]
        stop_groups(pgids, grace)
        return len(pgids), [pid for pgid in pgids for pid in group_members(pgid)]

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def save(data: RunRecord) -> Path:
    directory = runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{data['name']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path


def load_all() -> list[RunState]:
    """Every recorded run, oldest first; unreadable files are skipped."""
    found = []
    directory = runs_dir()
    if not directory.is_dir():
        return []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            found.append(RunState(data, path))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda r: float(r.data.get("started_at", 0)))


def select(name: str | None) -> list[RunState]:
    """Runs whose run name or topology name is `name` (all runs when None)."""
    runs = load_all()
    if name is None:
        return runs
    return [r for r in runs if name in (r.name, r.topology) or r.name.startswith(name)]


def age(run: RunState) -> str:
    seconds = time.time() - float(run.data.get("started_at", time.time()))
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
