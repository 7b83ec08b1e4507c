"""Per-request KV transfer time against bytes, from `pdctl verify` or `pdctl nightly` JSON.

Every PD request of a verify run carries `kv_transfer`: bytes moved to all decode
ranks, segments, staging or direct, the transport, and three times: decode's
`transfer_ms` (room registered to KV checked, prefill's prompt compute included),
prefill's `send_ms` (its whole send, waits for decode's ring included) and
`write_ms` (gathering, digests and transport writes only). This groups the serial
pass's requests of each topology by size and prints, per size: requests, bytes,
median write, send and receive ms, and the rate at the median write time. With
`--bound GBPS` (a device-to-device copy rate, e.g. from `pdctl bench staging`) it
adds the time a copy at that rate needs and its ratio to the write time.

    python benchmarks/kv_transfer_table.py REPORT.json [REPORT.json ...] [--pass serial]
        [--bound GBPS] [--json]

A nightly summary holds one report per topology; a verify report is one topology.
Exit 2 when a file holds no PD transfers (a skipped or colocated run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def reports_in(path: Path) -> list[dict[str, Any]]:
    """The verify reports a file holds: itself, or each topology's of a nightly summary."""
    data = json.loads(path.read_text())
    if "topologies" in data:
        return [entry["report"] for entry in data["topologies"] if entry.get("report")]
    return [data]


def rows_of(report: dict[str, Any], pass_name: str) -> list[dict[str, Any]]:
    """One row per transfer size in `pass_name` of one report."""
    sizes: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for one in report.get("passes", []):
        if one["name"] != pass_name:
            continue
        for request in one["requests"]:
            transfer = request.get("kv_transfer")
            if request.get("ok") and transfer and transfer.get("bytes"):
                sizes[int(transfer["bytes"])].append(transfer)
    topology = report.get("target", {}).get("topology", "?")
    rows = []
    for size, transfers in sorted(sizes.items()):
        write = _median(transfers, "write_ms")
        rows.append({
            "topology": topology,
            "transport": transfers[0].get("transport"),
            "path": "staging" if transfers[0].get("staging") else "direct",
            "requests": len(transfers),
            "bytes": size,
            "segments": max(int(t.get("segments", 0)) for t in transfers),
            "write_ms_p50": write,
            "gather_ms_p50": _median(transfers, "gather_ms"),
            "digest_ms_p50": _median(transfers, "digest_ms"),
            "send_ms_p50": _median(transfers, "send_ms"),
            "receive_ms_p50": _median(transfers, "transfer_ms"),
            "mb_per_s": round(size / 1e6 / (write / 1e3), 1) if write else None,
        })  # fmt: skip
    return rows


def _median(transfers: list[dict[str, Any]], key: str) -> float | None:
    """The median of `key` over the transfers that have it (None: a router that
    does not report prefill's side, such as sglang-router)."""
    values = [float(t[key]) for t in transfers if isinstance(t.get(key), (int, float))]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--pass", dest="pass_name", default="serial",
                        help="the verify pass to read (default: serial)")  # fmt: skip
    parser.add_argument("--bound", type=float, default=None,
                        help="a copy rate in GB/s to compare against")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for path in args.reports:
        try:
            found = [row for report in reports_in(path) for row in rows_of(report, args.pass_name)]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            sys.exit(f"{path}: not a pdctl verify or nightly JSON report ({exc})")
        if not found:
            print(f"{path}: no PD transfers in pass {args.pass_name!r}", file=sys.stderr)
            sys.exit(2)
        rows.extend(found)
    if args.bound:
        for row in rows:
            row["bound_ms"] = round(row["bytes"] / (args.bound * 1e9) * 1e3, 4)
            write = row["write_ms_p50"]
            row["bound_ratio"] = round(row["bound_ms"] / write, 4) if write else None
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    extra = " | copy-bound ms | bound / write" if args.bound else ""
    print("| topology | transport | path | requests | KiB | segments | write ms | (gather ms "
          f"| digest ms) | send ms | receive ms | MB/s at write{extra} |")  # fmt: skip
    print("|---" * (12 + (2 if args.bound else 0)) + "|")
    keys = ("write_ms_p50", "gather_ms_p50", "digest_ms_p50", "send_ms_p50", "receive_ms_p50")
    for row in rows:
        times = [_ms(row.get(key)) for key in keys]
        size = f"{row['bytes'] / 1024:,.0f}"
        cells = [row["topology"], row["transport"], row["path"], row["requests"], size,
                 row["segments"], *times, row["mb_per_s"] or "-"]  # fmt: skip
        if args.bound:
            cells += [f"{row['bound_ms']:.3f}", row["bound_ratio"] or "-"]
        print("| " + " | ".join(str(cell) for cell in cells) + " |")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
