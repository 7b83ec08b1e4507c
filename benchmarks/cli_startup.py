"""CLI start-up benchmark: wall time of the commands a user types first.

Runs each command several times in fresh processes, side by side with a bare
interpreter start in the same run, and prints medians and the ratio to the bare
start. `validate` and `plan` must not import torch; a regression shows here as a
jump of a second or more.

    python benchmarks/cli_startup.py [--runs N] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CATALOG = sorted(str(p) for p in (REPO / "topologies").glob("*.yaml"))
DEFAULT = str(REPO / "topologies" / "cpu-p1d2-tcp.yaml")
PDCTL = [sys.executable, "-m", "pdctl"]

CASES = {
    "python -c pass (baseline)": [sys.executable, "-c", "pass"],
    "pdctl --version": [*PDCTL, "--version"],
    f"pdctl validate ({len(CATALOG)} catalog files)": [*PDCTL, "validate", "-q", *CATALOG],
    "pdctl plan --json (default topology)": [*PDCTL, "plan", "--json", DEFAULT],
    "pdctl schema": [*PDCTL, "schema"],
}


def time_command(argv: list[str], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {name: time_command(argv, args.runs) for name, argv in CASES.items()}
    baseline = statistics.median(next(iter(results.values())))
    rows = [
        {
            "command": name,
            "median_s": round(statistics.median(samples), 4),
            "min_s": round(min(samples), 4),
            "ratio_to_bare_python": round(statistics.median(samples) / baseline, 2),
        }
        for name, samples in results.items()
    ]
    if args.json:
        print(json.dumps({"machine": platform.node(), "runs": args.runs, "rows": rows}, indent=2))
        return
    print(f"CLI start-up, {args.runs} runs each, {platform.machine()} {platform.python_version()}")
    print(f"{'command':<44} {'median s':>9} {'min s':>7} {'x bare python':>14}")
    for row in rows:
        print(
            f"{row['command']:<44} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
            f"{row['ratio_to_bare_python']:>14.1f}"
        )


if __name__ == "__main__":
    main()
