"""What each TP rank reports when it finished a room's KV, and rank 0's collector.

Every rank of a prefill (sending) or decode (receiving) server moves its own head
slice; rank 0 answers the request once all `tp` ranks reported. Rank 0's own report
arrives as a call, the others' over the TP group (`TPGroup.report`, a channel of its
own on host memory) as a `RoomReport`: `ReportSender` on each rank above 0,
`ReportCollector` on rank 0, which hands each one to the same handler as rank 0's
own; a sender or receiver reports through a `Report` (the room, its `RankReport`).
`RankReports` holds the rooms still waiting for ranks; `combine` makes the request's
`KVTransfer` of them. It knows nothing of the engine or of HTTP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from pdctl.records import KVTransfer
from pdctl.serve.pd.protocol import json_int

Entry = TypeVar("Entry")
log = logging.getLogger("pdctl.serve")
COUNTS = ("bytes", "segments")
TIMES = ("transfer_ms", "write_ms", "gather_ms", "digest_ms")


@dataclass
class RankReport:
    """One rank's part of a room: how much it moved and how long it took, or why not."""

    rank: int
    ok: bool
    error: str | None = None
    bytes: int = 0
    segments: int = 0
    staging: bool = False  # decode: through the staging ring
    notice: str = ""  # decode: how it heard the KV landed ("bell" or "message")
    transfer_ms: float = 0.0
    write_ms: float = 0.0  # prefill: gathering, digests and writes
    gather_ms: float = 0.0
    digest_ms: float = 0.0

    @staticmethod
    def from_json(data: Any) -> RankReport:
        """A report from JSON, its fields type-checked (ValueError names the field);
        other keys (the room it came with) are not the report's."""
        if not isinstance(data, dict):
            raise ValueError("a rank report is a JSON object")
        rank = data.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError("rank must be a non-negative integer")
        if not isinstance(data.get("ok"), bool):
            raise ValueError("ok must be true or false")
        error = data.get("error")
        if not data["ok"] and not isinstance(error, str):
            raise ValueError("a failed report needs its error as text")
        num_bytes, segments = (_count(data, name) for name in COUNTS)
        transfer_ms, write_ms, gather_ms, digest_ms = (_time(data, name) for name in TIMES)
        staging = data.get("staging", False)
        if not isinstance(staging, bool):
            raise ValueError("staging must be true or false")
        notice = data.get("notice", "")
        if notice not in ("", "bell", "message"):
            raise ValueError("notice must be 'bell' or 'message'")
        text = error[:2000] if isinstance(error, str) else None
        return RankReport(
            rank,
            data["ok"],
            text,
            bytes=num_bytes,
            segments=segments,
            staging=staging,
            notice=notice,
            transfer_ms=transfer_ms,
            write_ms=write_ms,
            gather_ms=gather_ms,
            digest_ms=digest_ms,
        )

    def checked(self) -> RankReport:
        """The report as rank 0 reads it (through `from_json`: its counts and times
        checked, ValueError if they do not hold; its error cut to 2,000 characters)."""
        return RankReport.from_json(self.to_json())

    def to_json(self) -> dict[str, object]:  # only ever serialized
        out = {
            "rank": self.rank,
            "ok": self.ok,
            "error": self.error,
            "staging": self.staging,
            "notice": self.notice,
        }
        return {**out, **{name: getattr(self, name) for name in (*COUNTS, *TIMES)}}


Report = Callable[[int, RankReport], None]  # (room, this rank's report of it)


def _count(data: Any, name: str) -> int:
    """A report's count: a non-negative integer, 0 when absent."""
    value = data.get(name, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative number")
    return value


def _time(data: Any, name: str) -> float:
    """A report's time in ms: a non-negative number (an integer stays one), 0 when absent."""
    value = data.get(name, 0)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative number")
    return value


def combine(reports: list[RankReport], transport: str, side: str) -> KVTransfer:
    """A room's transfer from its ranks' reports: bytes add up, the slowest rank's time
    and the most segments count. Prefill reports its write times, decode the path and
    whether every digest matched."""
    transfer = KVTransfer(
        bytes=sum(r.bytes for r in reports),
        segments=max(r.segments for r in reports),
        transport=transport,
        transfer_ms=max(float(r.transfer_ms) for r in reports),
    )
    if side == "prefill":
        transfer.write_ms = max(float(r.write_ms) for r in reports)
        transfer.gather_ms = max(float(r.gather_ms) for r in reports)
        transfer.digest_ms = max(float(r.digest_ms) for r in reports)
    else:
        transfer.staging = any(r.staging for r in reports)
        transfer.digest_ok = all(r.ok for r in reports)
        notices = {r.notice for r in reports if r.notice}
        if notices:
            transfer.notice = notices.pop() if len(notices) == 1 else "mixed"
    return transfer


@dataclass
class Pending(Generic[Entry]):
    """A room rank 0 waits on: what it needs once complete, and the reports so far."""

    entry: Entry
    reports: dict[int, RankReport] = field(default_factory=dict)

    @property
    def errors(self) -> list[str]:
        return [r.error or "failed" for r in self.reports.values() if not r.ok]


class RankReports(Generic[Entry]):
    """Rank 0's rooms still waiting for their ranks' reports (thread-safe)."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self._pending: dict[int, Pending[Entry]] = {}
        self._lock = threading.Lock()

    def expect(self, room: int, entry: Entry) -> None:
        with self._lock:
            self._pending[room] = Pending(entry)

    def waiting(self, room: int) -> bool:
        """Whether `room` still waits for a rank's report."""
        with self._lock:
            return room in self._pending

    def add(self, room: int, report: RankReport) -> Pending[Entry] | None:
        """Record a rank's report; the room, taken out, once every rank reported (None
        before, and for a room nobody expects: it ended already)."""
        with self._lock:
            pending = self._pending.get(room)
            if pending is None:
                return None
            pending.reports[report.rank] = report
            if len(pending.reports) < self.tp:
                return None
            return self._pending.pop(room)


@dataclass(frozen=True)
class RoomReport:
    """A rank's report of a room as it crosses the TP group: the report's JSON and the
    room, checked again on arrival (`RankReport.from_json`)."""

    room: int
    report: RankReport

    def to_bytes(self) -> bytes:
        return json.dumps({"room": self.room, **self.report.to_json()}).encode()

    @staticmethod
    def from_bytes(message: bytes) -> RoomReport:
        body = json.loads(message)
        if not isinstance(body, dict):
            raise ValueError("a rank report is a JSON object")
        return RoomReport(json_int(body, "room"), RankReport.from_json(body))


class ReportChannel(Protocol):
    """The TP group's side of it (`TPGroup.report`, `TPGroup.collect`)."""

    def report(self, message: bytes | None) -> None: ...

    def collect(self) -> tuple[int, bytes] | None: ...


class ReportSender:
    """Ranks > 0: the sender's or receiver's `report`, each to rank 0 over the channel.

    A report that does not check out raises here (ValueError), as rank 0 would refuse
    it: the caller reports the room failed instead."""

    def __init__(self, channel: ReportChannel) -> None:
        self.channel = channel

    def __call__(self, room: int, report: RankReport) -> None:
        self.channel.report(RoomReport(room, report.checked()).to_bytes())

    def close(self) -> None:
        """This rank reports no more (its worker loop ended): rank 0's collector ends
        once every rank said so. Nothing to say where rank 0 is gone."""
        with contextlib.suppress(RuntimeError):
            self.channel.report(None)


class ReportCollector:
    """Rank 0: a thread that hands every report the other ranks send to `deliver`, the
    handler of rank 0's own reports too, until every rank ended (`ReportSender.close`)."""

    def __init__(self, channel: ReportChannel, deliver: Callable[[int, RankReport], None]) -> None:
        self.channel, self.deliver = channel, deliver
        self.thread = threading.Thread(target=self._run, name="pdctl-rank-reports", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                message = self.channel.collect()
            except RuntimeError as exc:  # a rank died: the rank watch stops this server
                log.warning("rank reports: lost the other ranks: %s", exc)
                return
            if message is None:
                return
            rank, data = message
            try:
                item = RoomReport.from_bytes(data)
            except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
                log.error("rank reports: rank %d sent a malformed report: %s", rank, exc)
                continue
            try:
                self.deliver(item.room, item.report)
            except Exception:  # one room's bug must not stop every later report
                log.exception("rank reports: room %d of rank %d", item.room, rank)
