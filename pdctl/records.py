"""The JSON records that cross between pdctl's processes, typed once for both sides.

A server's `/get_server_info` (`ServerInfo`, with its KV pool, staging ring and the
KV prefill sent) and a request's `meta_info.kv_transfer` (`KVTransfer`). The servers
write them, the launcher, `pdctl verify`, the benchmarks and the tests read them.
`from_json` checks every field it knows (a ValueError names the field) and keeps the
ones it does not know, so `to_json` gives back what came in: the wire format is the
servers', other engines' servers included (an SGLang server's info has no KV pool).
This module imports nothing: the servers and the CLI share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from types import NoneType, UnionType
from typing import Any, TypeAlias, TypeVar, get_args, get_origin, get_type_hints

Record = TypeVar("Record")
NUMBER = (int, float)
Kinds = Mapping[str, tuple[type, ...]]  # field -> the JSON types it may have
# What JSON decodes to: what a record keeps unread and gives back (`extra`, `to_json`).
JSONValue: TypeAlias = str | int | float | bool | list["JSONValue"] | dict[str, "JSONValue"] | None


def _json_types(hint: Any) -> tuple[type, ...]:
    """The JSON types a field of type `hint` (`X | None`) may have: any number for a
    float, an object for a record, an array for a list."""
    if isinstance(hint, UnionType):  # X | None: the type it has when set
        (hint,) = [arg for arg in get_args(hint) if arg is not NoneType]
    kind = get_origin(hint) or hint  # list[int] -> list
    if kind is float:
        return NUMBER
    return (dict,) if is_dataclass(kind) else (kind,)


@cache
def _kinds(cls: type) -> Kinds:
    """Each field's JSON types, read from its annotation: the type is written once."""
    hints = get_type_hints(cls)
    return {f.name: _json_types(hints[f.name]) for f in fields(cls) if f.name != "extra"}


def _check(data: Any, name: str, kinds: tuple[type, ...], where: str) -> Any:
    value = data[name]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        kind = " or ".join("a number" if k in NUMBER else k.__name__ for k in kinds)
        raise ValueError(f"{where}.{name} must be {kind}, got {value!r}"[:300])
    return value


def _from(cls: type[Record], data: Any, where: str) -> Record:
    """`cls` from a JSON object: known fields type-checked, the others kept in `extra`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object")
    kinds = _kinds(cls)  # type: ignore[arg-type]  # a class is hashable
    values = {k: _check(data, k, kinds[k], where) for k in kinds if data.get(k) is not None}
    values["extra"] = {k: v for k, v in data.items() if k not in kinds}
    return cls(**values)


def _to(record: Any) -> dict[str, JSONValue]:
    """The record's JSON: its fields that are set, then what it kept unread."""
    out = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "extra"}
    return {**{k: v for k, v in out.items() if v is not None}, **record.extra}


@dataclass
class KVTransfer:
    """One request's KV transfer (`meta_info.kv_transfer`): decode's receive, with
    prefill's send added by the router (`write_ms`, `gather_ms`, `digest_ms`, and
    prefill's `transfer_ms` as `send_ms`); prefill's own answer has prefill's side."""

    bytes: int | None = None
    segments: int | None = None  # the most any rank of the room cut it into
    staging: bool | None = None  # decode: through the staging ring (else direct pages)
    transport: str | None = None
    digest_ok: bool | None = None  # decode: every rank's digests matched
    transfer_ms: float | None = None  # the slowest rank's
    cached_tokens: int | None = None  # decode: prefill's prefix-cache hit
    write_ms: float | None = None  # prefill gathering, digesting and writing
    gather_ms: float | None = None
    digest_ms: float | None = None
    send_ms: float | None = None  # prefill's whole send, waits for regions included
    notice: str | None = None  # decode: how it heard: "bell" (doorbell), "message", "mixed"
    extra: dict[str, JSONValue] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        return _to(self)

    @staticmethod
    def from_json(data: Any, where: str = "kv_transfer") -> KVTransfer:
        return _from(KVTransfer, data, where)

    def add_prefill_side(self, sent: KVTransfer) -> None:
        """Prefill's times of the same room (the router joins both answers)."""
        self.write_ms, self.gather_ms = sent.write_ms, sent.gather_ms
        self.digest_ms, self.send_ms = sent.digest_ms, sent.transfer_ms


@dataclass
class KVPool:
    """A server's KV pages: every page is free, cached (radix) or held by a request."""

    total_pages: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    extra: dict[str, JSONValue] = field(default_factory=dict)  # page_size, pool_tokens

    @property
    def held_pages(self) -> int:
        return self.total_pages - self.free_pages - self.cached_pages

    def to_json(self) -> dict[str, JSONValue]:
        return _to(self)

    @staticmethod
    def from_json(data: Any, where: str = "kv") -> KVPool:
        return _from(KVPool, data, where)


@dataclass
class RingState:
    """A decode server's staging ring."""

    capacity: int = 0
    live_regions: int = 0
    empty: bool = True
    watermark: list[int] | None = None  # [round, tail]
    extra: dict[str, JSONValue] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        return _to(self)

    @staticmethod
    def from_json(data: Any, where: str = "staging_ring") -> RingState:
        return _from(RingState, data, where)


@dataclass
class FenceState:
    """Memory a server holds for a PD room that ended while its KV may still be moving,
    until every writer (decode's pages and ring regions) or reader (prefill's pages) of
    it stopped; and how the rooms fenced so far were released."""

    rooms: int = 0  # fenced now
    pages: int = 0  # KV pages among them (this server's pool)
    regions: int = 0  # staging ring regions among them (decode rank 0's ring)
    released: int = 0  # released once prefill confirmed its senders stopped
    writer_gone: int = 0  # released because the writing process is gone (it writes no more)
    unconfirmed: int = 0  # released after the fence's bound without a confirmation
    extra: dict[str, JSONValue] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        return _to(self)

    @staticmethod
    def from_json(data: Any, where: str = "fence") -> FenceState:
        return _from(FenceState, data, where)


@dataclass
class KVSent:
    """What a prefill server sent since it started (benchmarks read the deltas)."""

    rooms: int = 0
    failed_rooms: int = 0
    bytes: int = 0
    write_ms: float = 0.0
    gather_ms: float = 0.0
    digest_ms: float = 0.0
    transfer_ms: float = 0.0
    extra: dict[str, JSONValue] = field(default_factory=dict)

    def add(self, transfer: KVTransfer, ok: bool) -> None:
        """One room more: its bytes and times when it went through."""
        if not ok:
            self.failed_rooms += 1
            return
        self.rooms += 1
        self.bytes += transfer.bytes or 0
        self.write_ms = round(self.write_ms + (transfer.write_ms or 0), 3)
        self.gather_ms = round(self.gather_ms + (transfer.gather_ms or 0), 3)
        self.digest_ms = round(self.digest_ms + (transfer.digest_ms or 0), 3)
        self.transfer_ms = round(self.transfer_ms + (transfer.transfer_ms or 0), 3)

    def to_json(self) -> dict[str, JSONValue]:
        return _to(self)

    @staticmethod
    def from_json(data: Any, where: str = "kv_sent") -> KVSent:
        return _from(KVSent, data, where)


@dataclass
class ServerInfo:
    """A server's `/get_server_info`, the parts pdctl reads; a router's lists its
    workers (`prefill`, `decode`: objects with a `url`)."""

    role: str | None = None
    dtype: str | None = None
    deterministic: bool | None = None
    running_requests: int | None = None
    waiting_requests: int | None = None
    open_rooms: int | None = None  # prefill: rooms not yet finished or failed
    kv: KVPool | None = None
    staging_ring: RingState | None = None  # decode
    kv_sent: KVSent | None = None  # prefill
    fence: FenceState | None = None
    prefill: list[Any] | None = None  # a router's workers
    decode: list[Any] | None = None
    extra: dict[str, JSONValue] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        out = _to(self)
        parts = {"kv": self.kv, "staging_ring": self.staging_ring, "kv_sent": self.kv_sent}
        for name, part in {**parts, "fence": self.fence}.items():
            if part is not None:
                out[name] = part.to_json()
        return out

    @staticmethod
    def from_json(data: Any, where: str = "/get_server_info") -> ServerInfo:
        info = _from(ServerInfo, data, where)
        if isinstance(info.kv, dict):
            info.kv = KVPool.from_json(info.kv, f"{where} kv")
        if isinstance(info.staging_ring, dict):
            info.staging_ring = RingState.from_json(info.staging_ring, f"{where} staging_ring")
        if isinstance(info.kv_sent, dict):
            info.kv_sent = KVSent.from_json(info.kv_sent, f"{where} kv_sent")
        if isinstance(info.fence, dict):
            info.fence = FenceState.from_json(info.fence, f"{where} fence")
        return info

    def worker_urls(self, side: str) -> list[str]:
        """A router's workers of one side (`prefill` or `decode`)."""
        workers = (self.prefill if side == "prefill" else self.decode) or []
        return [w["url"] for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]

    def leaks(self) -> list[str]:
        """What this server still holds with no request running: KV pages (the radix
        cache apart), requests, live ring regions, open rooms, rooms still fenced (their
        pages and regions are counted above too); and fenced memory released without its
        writers' confirmation. Empty: all back, and honestly."""
        problems = []
        if self.kv is None:
            problems.append("no KV pool state")
        elif self.kv.held_pages:
            problems.append(f"{self.kv.held_pages} KV pages held")
        if self.running_requests or self.waiting_requests:
            problems.append("requests still running")
        if self.staging_ring is not None and not self.staging_ring.empty:
            problems.append(f"{self.staging_ring.live_regions} ring regions live")
        if self.open_rooms:
            problems.append(f"{self.open_rooms} rooms open")
        if self.fence is not None and self.fence.rooms:
            problems.append(f"{self.fence.rooms} rooms fenced (waiting for their writers)")
        if self.fence is not None and self.fence.unconfirmed:
            problems.append(f"{self.fence.unconfirmed} fenced rooms released unconfirmed")
        return problems
