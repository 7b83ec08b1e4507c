"""Starting a server's other TP ranks: rank 0 spawns ranks 1..tp-1 as child processes.

Imports no torch, so rank 0 spawns them before its own imports (1.5 s of torch on a
small CPU) and the ranks start side by side instead of one after the other.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdctl.serve.args import ServerArgs


def first_of_many(args: ServerArgs) -> bool:
    """Rank 0 of a server with TP > 1: the one that spawns the others."""
    return args.tp > 1 and args.tp_rank == 0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn_ranks(world: int, argv: list[str], env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """Rank 0 starts ranks 1..world-1 in its own process group; they die with it.

    Under the launcher (PDCTL_LOG_DIR and PDCTL_PROCESS_NAME set) each rank writes
    its own log, `<process>-tp<rank>.log`; otherwise ranks share rank 0's output.
    """
    children = []
    log_dir, name = env.get("PDCTL_LOG_DIR"), env.get("PDCTL_PROCESS_NAME")
    for rank in range(1, world):
        log = open(f"{log_dir}/{name}-tp{rank}.log", "ab") if log_dir and name else None  # noqa: SIM115
        try:
            children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pdctl.serve", *argv, "--tp-rank", str(rank)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT if log else None,
                    preexec_fn=_die_with_parent,
                )
            )
        finally:
            if log is not None:
                log.close()
    return children
