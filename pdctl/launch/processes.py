"""Spawning and ending the processes of a run: process groups, parent-death signals, logs.

Each process starts in its own session (so its process group holds it and every
TP rank it spawns) with its output in its own log file. Unless the run is
detached, the kernel kills it when pdctl dies (PR_SET_PDEATHSIG), even by SIGKILL.
Processes are ended by process group (TERM, a grace period, KILL), and only ever
the groups this run started: never by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pdctl.launch.loopback import confine

PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ChildProcess(Protocol):
    """A process a run started, as the run holds it: spawned (`subprocess.Popen`) or
    forked from the run's forkserver (`forking.ForkedProcess`)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Spawned(Protocol):
    """A process a run started, wherever it runs (`LocalSpawned` on this host,
    `ray_launcher.RemoteSpawned` on a Ray node): what the run reads of it."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...  # its process group too (it leads its own session)

    @property
    def log_path(self) -> Path: ...  # rank 0's log in the run directory

    def exit_description(self) -> str | None: ...

    def log_tail(self, lines: int = 30) -> str: ...


@dataclass
class LocalSpawned:
    """A process started on this host: spawned, or forked from the run's forkserver."""

    name: str
    process: ChildProcess
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_description(self) -> str | None:
        """None while running; else 'exited with 3' or 'killed by SIGKILL'."""
        code = self.process.poll()
        if code is None:
            return None
        return describe_exit(code)

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"


def tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def process_env(
    base: Mapping[str, str], overrides: Mapping[str, str], host: str, loopback_shim: bool
) -> tuple[dict[str, str], str | None]:
    """The whole environment a process starts with, on this host or a Ray node (the one
    builder): `base` (its parent's) changed by `overrides` (the topology's and the
    run's), output unbuffered, kept on loopback where `host` is (`loopback.confine`);
    and what confinement could not do, if anything."""
    env = {**base, **overrides}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env, confine(env, host, loopback_shim)


def spawn(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    die_with_parent: bool = True,
    cwd: str | None = None,
    cores: tuple[int, ...] = (),
) -> LocalSpawned:
    """Start `argv` in its own session with its output in `log_path`; `cores` (if any)
    is the CPU affinity it and every thread and child it makes inherit."""

    def in_child() -> None:  # between fork and exec
        if die_with_parent:
            set_parent_death_signal()
        if cores:
            os.sched_setaffinity(0, cores)

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=in_child if die_with_parent or cores else None,
            cwd=cwd,
        )
    return LocalSpawned(name, process, log_path)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0]), or None."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the PID, its identity."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies waiting to be reaped do not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))


def pid_alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` runs (and, given `started`, is still the same process, not a reuse)."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return False
    return started is None or int(fields[19]) == started


def stop_groups(
    pgids: Sequence[int], grace: float = 5.0, reap: Sequence[ChildProcess] = ()
) -> list[int]:
    """TERM each group, wait up to `grace`, KILL what is left, reap; groups still alive."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for process in reap:
            process.poll()
        if not any(group_alive(pgid) for pgid in pgids):
            break
        time.sleep(0.05)
    for pgid in pgids:
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        for process in reap:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.05)
        if not any(group_alive(pgid) for pgid in pgids):
            return []
        time.sleep(0.05)
    return [pgid for pgid in pgids if group_alive(pgid)]
