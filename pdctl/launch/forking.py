"""A run's embedded servers forked from one process that imported them once.

`Starter` is how a `Run` starts its processes. On the CPU, for an attached run,
an embedded server (`python -m pdctl.serve ...`) is forked by a forkserver
(`pdctl.serve.forkserver`) that the starter spawns at the first such server and
closes after the run's processes have stopped; everything else, and every server
whose environment differs from the forkserver's in a variable read at import, is
spawned as before (`processes.spawn`). A forked server is owned as a spawned one
is: its own session (the launcher ends it by process group), its own log, killed
when the forkserver dies, which is killed when pdctl dies. Its exit status comes
from the forkserver, which reaps it; `ForkedProcess` holds it as `subprocess.Popen`
would (pid, poll, wait).

What it saves: each server's ~2 s of imports (torch 1.7 s) on every launch after the
first server of the run, CPU time a small host's servers otherwise spend in turn.
`LaunchSettings.forkserver` off (launch/settings.py) spawns every process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

from pdctl.launch.processes import (
    LocalSpawned,
    set_parent_death_signal,
    spawn,
    start_time,
    stop_groups,
)
from pdctl.launch.run_record import ForkserverRecord
from pdctl.launch.settings import LaunchSettings
from pdctl.settings import (
    FAULTS_VAR,
    LOG_DIR_VAR,
    PROCESS_NAME_VAR,
    RUN_ID_VAR,
    RUN_SECRET_VAR,
)

SERVER_MODULE = ("-m", "pdctl.serve")
# Read by a server after it is forked (its run, its name, its faults) or by transport
# libraries it imports only then: these may differ between a server and the forkserver.
LATE_VARS = frozenset({RUN_ID_VAR, RUN_SECRET_VAR, FAULTS_VAR, LOG_DIR_VAR, PROCESS_NAME_VAR})
LATE_PREFIXES = ("MC_", "MOONCAKE_", "NIXL_", "UCX_")
READY_TIMEOUT_S = 60.0
FORK_TIMEOUT_S = 30.0


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that the forkserver's imports could have read."""
    return {
        name: value
        for name, value in env.items()
        if name not in LATE_VARS and not name.startswith(LATE_PREFIXES)
    }


class ForkServerError(RuntimeError):
    """The forkserver could not start or fork (the starter then spawns instead)."""


class ForkedProcess:
    """A server forked by the forkserver: the part of `subprocess.Popen` a run uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """One forkserver process and its control pipe; a reader thread takes its replies."""

    def __init__(self, interpreter: str, title: str, env: Mapping[str, str], log: Path) -> None:
        self.env = import_env(env)
        self.interpreter = interpreter
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as stderr:
            self.process = spawn_control(
                [interpreter, "-m", "pdctl.serve.forkserver", title], self.env, stderr
            )
        self._lock = threading.Lock()
        self._next_id = 0
        self._replies: dict[int, Future[int]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._ready: Future[object] = Future()  # its Python threads, once imported
        self._gone = False
        threading.Thread(target=self._read, name="pdctl-forkserver", daemon=True).start()

    def accepts(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether forking this command is the same as spawning it."""
        return (
            len(argv) >= 3
            and argv[0] == self.interpreter
            and tuple(argv[1:3]) == SERVER_MODULE
            and import_env(env) == self.env
        )

    def wait_ready(self) -> None:
        """Until the imports are done; ForkServerError when it could not get there or a
        Python thread runs in it (a forked child would not have it)."""
        try:
            threads = self._ready.result(READY_TIMEOUT_S)
        except TimeoutError:
            raise ForkServerError(f"not ready within {READY_TIMEOUT_S:g} s") from None
        if threads != 1:
            raise ForkServerError(f"{threads} Python threads run in it")

    def fork(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> ForkedProcess:
        self.wait_ready()
        reply: Future[int] = Future()
        with self._lock:
            if self._gone:
                raise ForkServerError("the forkserver has exited")
            self._next_id += 1
            request = {
                "id": self._next_id,
                "args": list(argv[3:]),
                "env": dict(env),
                "log": str(log),
            }
            self._replies[self._next_id] = reply
            assert self.process.stdin is not None
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            except OSError as exc:
                raise ForkServerError(f"the forkserver's pipe: {exc}") from None
        try:
            pid = reply.result(FORK_TIMEOUT_S)
        except TimeoutError:
            raise ForkServerError(f"no fork within {FORK_TIMEOUT_S:g} s") from None
        with self._lock:
            child = self._children[pid] = ForkedProcess(pid)
            if pid in self._early_exits:
                child._set_exit(self._early_exits.pop(pid))
        return child

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._lock:
                if message.get("ready"):
                    self._ready.set_result(message.get("python_threads"))
                elif "exited" in message:
                    child = self._children.get(message["exited"])
                    if child is None:  # its fork's reply is still being handled
                        self._early_exits[message["exited"]] = message["code"]
                    else:
                        child._set_exit(message["code"])
                elif "error" in message:
                    self._replies.pop(message["id"]).set_exception(
                        ForkServerError(message["error"])
                    )
                else:
                    self._replies.pop(message["id"]).set_result(message["pid"])
        # the forkserver is gone: its children died with it (their parent-death signal)
        with self._lock:
            self._gone = True
            if not self._ready.done():
                self._ready.set_exception(ForkServerError("the forkserver exited while importing"))
            for reply in self._replies.values():
                reply.set_exception(ForkServerError("the forkserver exited"))
            for child in self._children.values():
                child._set_exit(-signal.SIGKILL)

    def close(self, grace: float = 5.0) -> None:
        """Close its stdin (it exits), after the servers it forked have stopped."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace)
        stop_groups([self.process.pid], 1.0, [self.process])


def spawn_control(argv: list[str], env: Mapping[str, str], stderr: IO[bytes]) -> Any:
    """The forkserver spawned with pipes on stdin and stdout, in its own session, killed
    when pdctl dies."""
    return subprocess.Popen(
        argv,
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=set_parent_death_signal,
    )


class Starter:
    """How a run starts its processes: forked where that is the same as spawning
    (`ForkServer.accepts`), else spawned. Closed after the run's processes stopped."""

    def __init__(self, title: str, log_dir: Path, *, forks: bool) -> None:
        self.title = title
        self.log_dir = log_dir
        self.forks = forks
        self.server: ForkServer | None = None
        self.warning: str | None = None  # why forking was given up, once
        self._lock = threading.Lock()  # one forkserver, whichever thread spawns first

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        die_with_parent: bool = True,
        cwd: Path | None = None,
        cores: tuple[int, ...] = (),
    ) -> LocalSpawned:
        forkable = die_with_parent and cwd is None and not cores
        server = self._server_for(argv, env) if forkable else None
        if server is not None and server.accepts(argv, env):
            log_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                return LocalSpawned(name, server.fork(argv, env, log_path), log_path)
            except ForkServerError as exc:
                self._give_up(str(exc))
        where = None if cwd is None else str(cwd)
        return spawn(
            name, argv, env, log_path, die_with_parent=die_with_parent, cwd=where, cores=cores
        )

    def _server_for(self, argv: Sequence[str], env: Mapping[str, str]) -> ForkServer | None:
        if not self.forks or tuple(argv[1:3]) != SERVER_MODULE:
            return None
        with self._lock:
            if self.server is None:
                log = self.log_dir / "forkserver.log"
                try:
                    self.server = ForkServer(argv[0], self.title, env, log)
                except OSError as exc:
                    self._give_up(f"could not start it: {exc}")
            return self.server

    def _give_up(self, why: str) -> None:
        self.forks = False
        log = self.log_dir / "forkserver.log"
        self.warning = f"servers are spawned, not forked: forkserver: {why} (its log: {log})"

    def describe(self) -> ForkserverRecord | None:
        """The forkserver's pid and start time while it runs (for run.json), else None."""
        if self.server is None:
            return None
        pid = self.server.process.pid
        return {"pid": pid, "start_time": start_time(pid)}

    def close(self) -> None:
        """End the forkserver (after the run's processes have stopped); a later spawn
        starts a new one."""
        with self._lock:
            server, self.server = self.server, None
        if server is not None:
            server.close()


def forks_by_default(device: str, settings: LaunchSettings) -> bool:
    """Whether a run forks its servers: on the CPU, unless `settings.forkserver` is off."""
    return device == "cpu" and settings.forkserver and hasattr(os, "fork")
