"""The builtin PD router: one request goes to a prefill and a decode server at once.

workers.py holds the workers and their health, forward.py how one request is
forwarded (bootstrap fields added, both sides at once, failures named by side),
app.py the HTTP application. Imports no torch: the router starts in a fraction of a
second and never loads the engine.
"""

from __future__ import annotations

import logging
import time

from pdctl.serve.args import ServerArgs
from pdctl.serve.router.app import create_router_app
from pdctl.serve.router.workers import RouterState, Worker

log = logging.getLogger("pdctl.serve")

__all__ = ["RouterState", "Worker", "create_router_app", "run"]


def run(args: ServerArgs) -> None:
    from pdctl.serve.http import run_servers, set_identity

    set_identity(args)
    if not args.prefill or not args.decode:
        raise SystemExit(
            "the router needs at least one --prefill URL BOOTSTRAP_PORT and one --decode URL"
        )
    state = RouterState(
        prefill=[Worker("prefill", url.rstrip("/"), port) for url, port in args.prefill],
        decode=[Worker("decode", url.rstrip("/")) for url in args.decode],
        timeout=args.request_timeout,
        encoder=[Worker("encoder", url.rstrip("/")) for url in args.encoder],
        flow=args.pd_flow,
    )
    log.info(
        "routing %d prefill and %d decode workers (%s)",
        len(state.prefill),
        len(state.decode),
        time.strftime("%H:%M:%S"),
    )
    run_servers([(create_router_app(state), args.host, args.port)])
