"""A server process's identity (title, log format) and serving its HTTP apps until told
to stop: every role's, and the router's. Imports no torch: the router, which computes
nothing, starts in a fraction of a second (importing torch through the roles cost it
2.2 s of CPU at every launch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from pdctl.serve.args import ServerArgs
from pdctl.titles import rank_title


def set_identity(args: ServerArgs) -> None:
    title = rank_title(args.topology_name, args.role, args.tp_rank, args.replica)
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # the title is a convenience, not a requirement
        pass
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s [{args.title_role} tp{args.tp_rank}] %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


GRACE_S = 2


# An idle HTTP connection stays open this long; the router's pooled client lets its
# own go sooner (router/app.py CLIENT_KEEP_ALIVE_S). With both at 5 s, as uvicorn's and
# httpx's defaults are, the router could reuse a connection a server was closing that
# instant: "connection reset by peer" (one request of 10,000 in the nixl soak at 64).
KEEP_ALIVE_S = 30


# Set once this server was told to stop (SIGTERM / SIGINT): ranks ending after it are
# the stop itself (a launcher signals the whole process group), not a death.
STOPPING = threading.Event()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # signals are handled once for all servers
        yield


def run_servers(apps: list[tuple[FastAPI, str, int]]) -> None:
    """Serve every app until SIGTERM or SIGINT, in one event loop.

    Requests still waiting (a KV transfer, a long generation) get GRACE_S to finish;
    a second signal ends the servers at once.
    """
    servers = [
        _Server(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=GRACE_S,
                timeout_keep_alive=KEEP_ALIVE_S,
            )
        )
        for app, host, port in apps
    ]

    def stop(*_: object) -> None:
        STOPPING.set()
        for server in servers:
            if server.should_exit:
                server.force_exit = True
            server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    async def main() -> None:
        await asyncio.gather(*(server.serve() for server in servers))

    asyncio.run(main())
