"""`python -m pdctl.serve.forkserver`: a CPU run's servers forked from one process
that imported their modules once (`pdctl.launch.forking` is the launcher's side).

A server spends about 2 s of CPU importing torch, FastAPI and its own modules
before it does anything of its own; a topology with its reference starts three to
five of them, and on a small host they take those seconds in turn. This process
imports them once, says so, and then forks one server per request:

    launcher -> forkserver (stdin)   {"id": 3, "args": [...], "env": {...}, "log": "..."}
    forkserver -> launcher (stdout)  {"ready": true, "pid": ..., "python_threads": 1}
                                     {"id": 3, "pid": 4242}  or  {"id": 3, "error": "..."}
                                     {"exited": 4242, "code": -15}

A forked server is what a spawned one is: its own session (so its process group
holds it and its TP ranks), its log on stdout and stderr, stdin on /dev/null, the
environment of the request (`os.environ`, and the C library's, which is what
every library reads; /proc/PID/environ alone still shows the forkserver's, being
the block the process was executed with; variables read at import are the
launcher's to keep equal: it forks only where they are), killed when this process dies, and this
process is killed when the launcher dies (both PR_SET_PDEATHSIG). The server runs
in the forked child as `python -m pdctl.serve ARGS` would, and exits the same way.
This process reaps its children and reports each exit; it ends when its stdin
closes, which the launcher does once the servers it forked have stopped.

Only the CPU is served: on an accelerator a child forked from a parent that touched
the driver cannot use the device, and the servers spawn there as before.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import pdctl.serve.__main__ as serve_main
from pdctl.serve.ranks import die_with_parent
from pdctl.titles import helper_title

# What a server of any role imports before it reads its arguments' consequences.
PRELOADED = (  # pdctl.serve.__main__ (arguments, ranks) is imported above
    "pdctl.serve.runtime",
    "pdctl.serve.model.weights",
    "pdctl.serve.roles.colocated",
    "pdctl.serve.roles.prefill",
    "pdctl.serve.roles.decode",
    "pdctl.serve.router",
)


@dataclass(frozen=True)
class ForkRequest:
    """One server to fork: its `pdctl.serve` arguments, environment and log file."""

    id: int
    args: list[str]
    env: dict[str, str]
    log: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ForkRequest:
        return cls(int(data["id"]), [str(a) for a in data["args"]], dict(data["env"]), data["log"])


def _send(message: dict[str, Any]) -> None:
    """One line to the launcher, on the raw descriptor (nothing buffered to inherit)."""
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def _reap(children: set[int]) -> None:
    """Report every child that has exited, without blocking."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve_forks() -> tuple[ForkRequest, int]:
    """Fork a server per request until stdin closes (then exit); returns only in a
    forked child: its request, and the pipe to close once it has its session."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)  # a child's exit wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_read], [], [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_read, 4096):
                    pass
            _reap(children)
        if 0 not in readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the launcher is done with us (or gone); nothing to flush or
            os._exit(0)  # collect (the interpreter's exit would spend ~1 s on torch's objects)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = ForkRequest.from_json(json.loads(line))
            started_read, started_write = os.pipe()
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(started_read)
                os.close(started_write)
                _send({"id": request.id, "error": f"fork: {exc}"})
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_read, wake_write, started_read):
                    os.close(fd)
                return request, started_write
            children.add(pid)
            # the pid is told once the child has its own session (`become` closes the
            # pipe then): a launcher that ends the group at once must find it there
            os.close(started_write)
            os.read(started_read, 1)
            os.close(started_read)
            _send({"id": request.id, "pid": pid})


def become(request: ForkRequest, started: int, parent: int) -> None:
    """In the forked child: the spawned server's session, descriptors and environment
    (`started` closed once the session and the parent-death signal are in place)."""
    try:
        os.setsid()
        die_with_parent()
        if os.getppid() != parent:  # the forkserver ended before the signal was set
            os._exit(1)
        os.close(started)
        log = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.environ.clear()
        os.environ.update(request.env)
        sys.argv = [serve_main.__file__, *request.args]
    except BaseException as exc:
        os.write(2, f"pdctl forkserver: could not start the server: {exc!r}\n".encode())
        os._exit(1)


def _set_title(topology: str) -> None:
    """`pdctl:<topology>:forkserver`. Also what lets a forked server set its own title:
    setproctitle takes over the process's argument and environment block at its first
    call, which must come before the environment is replaced (`become`)."""
    try:
        import setproctitle
    except ImportError:  # the title is a convenience, not a requirement
        return
    setproctitle.setproctitle(helper_title(topology, "forkserver"))


def main() -> None:
    _set_title(sys.argv[1] if len(sys.argv) > 1 else "run")
    for name in PRELOADED:
        importlib.import_module(name)
    # What the imports made lives as long as every server forked from here: frozen, a
    # server's collections never walk it (nor write to its pages, which the fork shares).
    # Unfrozen, the colocated server answered 4 requests at a time about 20% slower once
    # prefill's and decode's modules grew by six (bench pd, 470 against 570 tok/s).
    gc.freeze()
    # Python threads would not exist in a forked child (native ones, such as OpenBLAS's
    # workers, handle the fork themselves, as the CPU TP ranks forked after these
    # imports rely on): the launcher forks nothing where this is not 1.
    _send({"ready": True, "pid": os.getpid(), "python_threads": threading.active_count()})
    parent = os.getpid()
    request, started = serve_forks()
    become(request, started, parent)
    serve_main.main(request.args)
    gc.freeze()  # as `python -m pdctl.serve` ends: no final collection of torch's objects


if __name__ == "__main__":
    main()
