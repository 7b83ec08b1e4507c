"""Starting a server's other TP ranks: rank 0 starts ranks 1..tp-1 as child processes.

On an accelerator rank 0 spawns them before its own imports (this module imports no
torch), so the ranks import torch side by side instead of one after the other: a
child forked after its parent touched the device driver could not use the device.
On the CPU rank 0 forks them once the server's modules are imported
(`fork_ranks`): a rank then starts in milliseconds instead of repeating about 1.5 s
of imports, CPU time the ranks of a small host would otherwise spend in turn
(`--no-fork-ranks` spawns them there too).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdctl.serve.args import ServerArgs
    from pdctl.serve.settings import Handoff


class RankProcess(Protocol):
    """Another rank of this server, as rank 0 holds it: spawned (`subprocess.Popen`)
    or forked (`ForkedRank`)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def first_of_many(args: ServerArgs) -> bool:
    """Rank 0 of a server with TP > 1: the one that spawns the others."""
    return args.tp > 1 and args.tp_rank == 0


def forks_ranks(args: ServerArgs) -> bool:
    """Whether rank 0 forks its other ranks after its imports (the CPU) rather than
    spawning them before (an accelerator, or `--no-fork-ranks`)."""
    return (
        first_of_many(args)
        and args.device == "cpu"
        and args.settings.fork_ranks
        and hasattr(os, "fork")
    )


def die_with_parent() -> None:  # in a child, after fork (and before exec, if any)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_log(handoff: Handoff, rank: int) -> str | None:
    """Under the launcher (a run directory and a process name handed over) a rank's log."""
    if not handoff.launched:
        return None
    return f"{handoff.log_dir}/{handoff.process_name}-tp{rank}.log"


class ForkedRank:
    """A rank forked by rank 0: the part of `subprocess.Popen` a server uses (pid,
    poll, wait, send_signal), safe to call from the rank watcher's thread and the
    stopping one at once."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its status is lost
                    self.returncode = -signal.SIGKILL
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def fork_ranks(world: int, handoff: Handoff) -> tuple[int, list[RankProcess]]:
    """Rank 0 forks ranks 1..world-1 (they die with it); returns this process's rank
    and, in rank 0, its children. Under the launcher each rank writes its own log,
    `<process>-tp<rank>.log`, as spawned ranks do."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    children: list[RankProcess] = []
    for rank in range(1, world):
        log = _rank_log(handoff, rank)
        pid = os.fork()
        if pid == 0:
            try:
                die_with_parent()
                if os.getppid() != parent:  # rank 0 ended before the death signal was set
                    os._exit(1)
                if log is not None:
                    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
            except BaseException:
                os._exit(1)
            return rank, []
        children.append(ForkedRank(pid))
    return 0, children


def spawn_ranks(
    world: int, argv: list[str], env: dict[str, str], handoff: Handoff
) -> list[RankProcess]:
    """Rank 0 starts ranks 1..world-1 (environment `env`) in its own process group; they
    die with it. Under the launcher each rank writes its own log,
    `<process>-tp<rank>.log`; otherwise ranks share rank 0's output.
    """
    children: list[RankProcess] = []
    for rank in range(1, world):
        path = _rank_log(handoff, rank)
        log = open(path, "ab") if path is not None else None  # noqa: SIM115
        try:
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pdctl.serve", *argv, "--tp-rank", str(rank)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT if log else None,
                    preexec_fn=die_with_parent,
                )
            )
        finally:
            if log is not None:
                log.close()
    return children
