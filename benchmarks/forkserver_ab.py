"""Servers forked from the run's forkserver against servers spawned, side by side.

Runs `make demo`'s verify (the default topology, serial compare, the colocated
reference) in rounds that alternate PDCTL_FORKSERVER=1 and =0, and prints for each
round the launch time the report gives, the wall time of the whole command and the
CPU time it and every process under it used (user + system, from the kernel's
accounting of reaped children: forked servers are reaped by the forkserver, which
pdctl reaps, so both ways count every server).

    python benchmarks/forkserver_ab.py [TOPOLOGY] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PDCTL = [sys.executable, "-m", "pdctl"]


def one_round(topology: str, forks: bool, scratch: Path) -> dict[str, float]:
    report = scratch / f"verify-{int(forks)}.json"
    env = {**os.environ, "PDCTL_FORKSERVER": "1" if forks else "0"}
    argv = [*PDCTL, "verify", topology, "--serial-compare", "--reference", "--json", str(report)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    timings = json.loads(report.read_text()).get("phases", {})
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"launch_s": float(timings.get("launch_s", float("nan"))), "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topology", nargs="?", default=str(REPO / "topologies/cpu-p1d2-tcp.yaml"))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    options = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"forked": [], "spawned": []}
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(options.rounds):
            for forks in (True, False) if number % 2 == 0 else (False, True):
                row = one_round(options.topology, forks, Path(scratch))
                rows["forked" if forks else "spawned"].append(row)
                if not options.json:
                    print(f"round {number + 1} {'forked ' if forks else 'spawned'} "
                          f"launch {row['launch_s']:.2f} s  wall {row['wall_s']:.2f} s  "
                          f"cpu {row['cpu_s']:.2f} s", flush=True)  # fmt: skip
    medians = {
        way: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for way, runs in rows.items()
    }
    if options.json:
        print(json.dumps({"machine": platform.machine(), "rounds": rows, "medians": medians}))
        return
    for way, values in medians.items():
        print(f"median {way:8s} launch {values['launch_s']:.2f} s  wall {values['wall_s']:.2f} s"
              f"  cpu {values['cpu_s']:.2f} s")  # fmt: skip
    forked, spawned = medians["forked"], medians["spawned"]
    ratios = ", ".join(
        f"{what} {forked[key] / spawned[key]:.2f}"
        for what, key in (("launch", "launch_s"), ("wall", "wall_s"), ("cpu", "cpu_s"))
    )
    print(f"forked / spawned: {ratios}")


if __name__ == "__main__":
    main()
