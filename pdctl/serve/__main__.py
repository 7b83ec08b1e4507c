"""`python -m pdctl.serve --role ROLE ...`: one server (rank 0 spawns its other TP ranks)."""

from __future__ import annotations

import sys

from pdctl.serve.args import parse
from pdctl.serve.runtime import run_worker, start_rank


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.role != "colocated":
        raise SystemExit(f"role {args.role!r} is not available in this build yet")
    rank = start_rank(args, argv)
    if args.tp_rank > 0:
        run_worker(rank)
        return
    from pdctl.serve.roles import colocated

    colocated.run(rank)


if __name__ == "__main__":
    main(sys.argv[1:])
