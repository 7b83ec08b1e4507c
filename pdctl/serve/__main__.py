"""`python -m pdctl.serve --role ROLE ...`: one server (rank 0 starts its other TP ranks:
spawned before its imports on an accelerator, forked after them on the CPU; `ranks`)."""

from __future__ import annotations

import gc
import importlib
import os
import sys

from pdctl.serve.args import parse
from pdctl.serve.ranks import (
    RankProcess,
    first_of_many,
    fork_ranks,
    forks_ranks,
    spawn_ranks,
)
from pdctl.serve.settings import Handoff

ROLES = {
    "colocated": "pdctl.serve.roles.colocated",
    "prefill": "pdctl.serve.roles.prefill",
    "decode": "pdctl.serve.roles.decode",
    "encoder": "pdctl.serve.roles.encoder",
}


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.role == "router":
        from pdctl.serve import router

        router.run(args)
        return
    if args.role not in ROLES:
        raise SystemExit(f"role {args.role!r} is not served by this build")
    handoff = Handoff.from_environ(os.environ)
    forking = forks_ranks(args)
    # On an accelerator the other TP ranks start now, importing torch beside this rank.
    children: list[RankProcess] = []
    if first_of_many(args) and not forking:
        children = spawn_ranks(args.tp, argv, dict(os.environ), handoff)
    schedule = args.settings.cuda_schedule
    if schedule and args.device.startswith("cuda"):  # before torch makes a context
        from pdctl.staging.held import set_schedule

        why = set_schedule(schedule)
        if why is not None:
            raise SystemExit(f"--cuda-schedule {schedule}: {why}")
    from pdctl.serve.model.weights import CheckpointError  # torch: not for the router
    from pdctl.serve.runtime import start_rank

    if args.role in ("prefill", "decode"):
        # KV threads beside the engine's loop wait for the GIL up to this long per call
        sys.setswitchinterval(args.settings.switch_interval_us / 1e6)
    role = importlib.import_module(ROLES[args.role])
    if forking:  # on the CPU: forked now, the imports done once for every rank
        rank_number, children = fork_ranks(args.tp, handoff)
        if rank_number:
            argv = [*argv, "--tp-rank", str(rank_number)]
            args = parse(argv)
    try:
        rank = start_rank(args, argv, children)
    except CheckpointError as exc:  # a user's checkpoint: one line, never a traceback
        raise SystemExit(f"pdctl serve {args.title_role} tp{args.tp_rank}: {exc}") from None
    if args.tp_rank > 0:
        if hasattr(role, "run_worker"):
            role.run_worker(rank)
        else:
            from pdctl.serve.runtime import run_worker

            run_worker(rank)
        return
    role.run(rank)


if __name__ == "__main__":
    main(sys.argv[1:])
    # Everything the server owns is closed by now. The interpreter's final collection
    # of torch's object graph cost 0.5-1 s of every server's exit (a topology's
    # teardown waits for its slowest process): frozen objects are not collected, and
    # exit handlers still run.
    gc.freeze()
