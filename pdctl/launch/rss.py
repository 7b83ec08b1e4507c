"""Resident memory (and threads) of a run's processes, one figure per PID, from /proc.

A server is a process group (rank 0 and, with TP > 1, the ranks it spawned, plus
any helper of theirs); each member is sampled on its own, so a leak in one TP rank
is not averaged away by its siblings. Growth is compared only for PIDs seen at both
samples; a PID that vanished or appeared is reported, never hidden.
Knows nothing of HTTP or of what the processes serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from pdctl.launch.processes import group_members
from pdctl.titles import is_pdctl_title


@dataclass(frozen=True)
class ProcessRss:
    server: str  # the run's process (its group) this PID belongs to: prefill-0, router
    pid: int
    title: str  # pdctl:<topology>:<role>:tp<rank>, or the command name of a helper
    rss_kib: int
    threads: int = 0  # a pool that grew under load shows here (each thread has a stack)


class RssFields(TypedDict):
    server: str
    pid: int
    title: str
    rss_warm_mib: float
    rss_end_mib: float
    growth_pct: float
    threads_warm: int
    threads_end: int


class RssRow(RssFields, total=False):
    """One PID's resident memory at both samples, as the soak reports it."""

    trace_mib: dict[int, float]  # requests done -> MiB, at every tenth of the load


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            words = handle.read().split(b"\0")
    except OSError:
        return "?"
    first = words[0].decode(errors="replace").strip() if words else ""
    if is_pdctl_title(first):
        return first
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return first or "?"


def status(pid: int) -> tuple[int, int] | None:
    """(VmRSS in KiB, threads) of `pid`; None when it is gone (or a kernel thread)."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "Threads"):
                    fields[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if "VmRSS" not in fields:
        return None
    return fields["VmRSS"], fields.get("Threads", 0)


def sample(groups: dict[str, int]) -> list[ProcessRss]:
    """Every live member of each group (server name -> process group id), by PID."""
    found = []
    for server, pgid in groups.items():
        for pid in sorted(group_members(pgid)):
            read = status(pid)
            if read is not None:
                found.append(ProcessRss(server, pid, _title(pid), read[0], read[1]))
    return found


def growth(
    warm: list[ProcessRss], end: list[ProcessRss], limit_pct: float
) -> tuple[list[RssRow], list[str]]:
    """Per PID: RSS at both samples and growth in %; and the problems (growth at or over
    `limit_pct`, a PID gone or new between the samples)."""
    later = {p.pid: p for p in end}
    rows: list[RssRow] = []
    problems: list[str] = []
    for first in warm:
        last = later.pop(first.pid, None)
        if last is None:
            problems.append(f"{first.server} pid {first.pid} ({first.title}) is gone")
            continue
        pct = round(100.0 * (last.rss_kib - first.rss_kib) / max(first.rss_kib, 1), 2)
        rows.append(
            {
                "server": first.server,
                "pid": first.pid,
                "title": first.title,
                "rss_warm_mib": round(first.rss_kib / 1024, 1),
                "rss_end_mib": round(last.rss_kib / 1024, 1),
                "growth_pct": pct,
                "threads_warm": first.threads,
                "threads_end": last.threads,
            }
        )
        if pct >= limit_pct:
            problems.append(
                f"{first.server} pid {first.pid} ({first.title}) grew {pct:.2f} % "
                f"(limit {limit_pct:g} %): {first.rss_kib // 1024} -> {last.rss_kib // 1024} MiB"
            )
    for extra in later.values():
        problems.append(f"{extra.server} pid {extra.pid} ({extra.title}) appeared after warm-up")
    return rows, problems
