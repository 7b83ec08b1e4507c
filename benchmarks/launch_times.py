"""Launch benchmark: `pdctl up --detach` of a topology to ready, `pdctl down` to nothing left.

Each round brings the topology up in a fresh pdctl process (ports, spawn, layered
readiness, the canary request through the router) and takes it down again (TERM,
grace, KILL, check that no process of any group is left). Prints every round,
the medians and the targets (<= 15 s up, <= 5 s down on a 2-core machine).

    python benchmarks/launch_times.py [TOPOLOGY] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PDCTL = [sys.executable, "-m", "pdctl"]
TARGETS = {"up_s": 15.0, "down_s": 5.0}


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topology", nargs="?", default=str(REPO / "topologies/cpu-p1d2-tcp.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdctl-launch-bench-") as scratch:
        env = {**os.environ, "PDCTL_STATE_DIR": scratch}
        for index in range(args.rounds):
            up = timed([*PDCTL, "up", args.topology, "--detach", "-q",
                        "--run-dir", f"{scratch}/run{index}"], env)  # fmt: skip
            down = timed([*PDCTL, "down", "--all", "-q"], env)
            rows.append({"round": index + 1, "up_s": round(up, 2), "down_s": round(down, 2)})
            if not args.json:
                print(f"round {index + 1}: up {up:.2f} s, down {down:.2f} s", flush=True)
    report = {
        "topology": args.topology,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rounds": rows,
        "median_up_s": round(statistics.median(r["up_s"] for r in rows), 2),
        "median_down_s": round(statistics.median(r["down_s"] for r in rows), 2),
        "targets": TARGETS,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"median: up {report['median_up_s']:.2f} s (target <= {TARGETS['up_s']:g} s, "
        f"{report['median_up_s'] / TARGETS['up_s']:.2f} of it), down "
        f"{report['median_down_s']:.2f} s (target <= {TARGETS['down_s']:g} s, "
        f"{report['median_down_s'] / TARGETS['down_s']:.2f} of it)"
    )


if __name__ == "__main__":
    main()
