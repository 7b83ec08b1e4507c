"""Messages of the PD protocol: registrations, segments, notifications, JSON tensors.

    decode rank d  --POST /bootstrap/register-->  prefill bootstrap (rank 0)
                   --POST /bootstrap/segments-->  (more ring regions as they free)
    prefill rank w --write region or pages, notify "pd:<room>:<segment>:<w>|{digests}"-->
                                                              decode rank d
    decode rank 0  --GET /bootstrap/result/<room>--> first token, cached tokens

Every message is JSON; tensors between ranks carry JSON as UTF-8 bytes in int64
tensors. Nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pdctl.staging.allocator import Region, Watermark
from pdctl.staging.doorbell import BoxInfo, Ticket

DIRECT_SEGMENT = -1  # the segment index of a direct (unstaged) page write


class BootstrapError(Exception):
    """A bootstrap message refused: the message, and the HTTP status it is answered with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SegmentRegion:
    """One ring region a decode rank offers for one segment of a room."""

    index: int
    page_start: int
    num_pages: int
    address: int  # ring base + physical offset
    start: int  # logical position (for the writable check)
    size: int
    capacity: int
    watermark: tuple[int, int]

    def writable(self) -> bool:
        region = Region(self.start, self.size, self.capacity)
        return region.writable(Watermark(*self.watermark))


@dataclass
class BellOffer:
    """A direct room's doorbells (same host): the decode rank's box and one ticket per
    writer, in writer order; a writer that can open the box rings its ticket instead
    of sending a notification (`staging.doorbell`)."""

    box: BoxInfo
    tickets: list[Ticket]

    @staticmethod
    def from_json(data: Any) -> BellOffer:
        if not isinstance(data, dict) or set(data) != {"box", "tickets"}:
            raise ValueError("bell has exactly the fields box and tickets")
        box = BoxInfo.from_json(data["box"])
        tickets = []
        for item in _list(data["tickets"], "bell tickets"):
            if not isinstance(item, dict) or set(item) != {"slot", "seq"}:
                raise ValueError("a bell ticket has exactly the fields slot and seq")
            slot, seq = json_int(item, "slot"), json_int(item, "seq")
            if slot >= box.slots or seq == 0:
                raise ValueError(f"bell ticket (slot {slot}, seq {seq}) is outside the box")
            tickets.append(Ticket(slot, seq))
        return BellOffer(box, tickets)


@dataclass
class Registration:
    room: int
    decode_rank: int
    decode_tp: int
    decode_name: str
    transport: str  # base64 description of the decode rank's transport
    num_tokens: int
    page_size: int
    mode: str  # "staging" | "direct"
    kv_heads: int
    head_dim: int
    num_layers: int
    elem_bytes: int
    segment_bytes: int  # decode's segment size: both sides cut the room the same way
    pages: list[int] = field(default_factory=list)  # decode pages of the prompt
    kv_bases: list[list[int]] = field(default_factory=list)  # direct: [k, v] address per layer
    segments: list[SegmentRegion] = field(default_factory=list)
    bell: BellOffer | None = None  # direct, same host: ring these instead of notifying

    def to_json(self) -> dict[str, object]:  # only ever serialized
        return asdict(self)

    @staticmethod
    def from_json(data: Any) -> Registration:
        """A registration from JSON, every field type-checked (ValueError names the field)."""
        if not isinstance(data, dict):
            raise ValueError("a registration is a JSON object")
        unknown = set(data) - set(Registration.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        for name in INT_FIELDS:
            json_int(data, name)
        for name in ("decode_name", "transport"):
            if not isinstance(data.get(name), str) or len(data[name]) > MAX_TEXT:
                raise ValueError(f"{name} must be text (at most {MAX_TEXT} characters)")
        if data.get("mode") not in ("staging", "direct"):
            raise ValueError("mode must be 'staging' or 'direct'")
        if not 0 <= data["decode_rank"] < data["decode_tp"]:
            raise ValueError(f"decode_rank {data['decode_rank']} is not below decode_tp")
        pages = data.get("pages", [])
        if not isinstance(pages, list) or len(pages) > MAX_LIST:
            raise ValueError(f"pages must be a list of at most {MAX_LIST} integers")
        bases = data.get("kv_bases", [])
        if not isinstance(bases, list) or len(bases) > MAX_LIST:
            raise ValueError("kv_bases must be a list of [k, v] address pairs")
        for item in [*pages, *(a for pair in bases for a in _pair(pair))]:
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise ValueError("pages and kv_bases hold non-negative integers")
        segments = [segment_from_json(s) for s in _list(data.get("segments", []), "segments")]
        bell = data.get("bell")
        if bell is not None:
            bell = BellOffer.from_json(bell)
        return Registration(**{**data, "segments": segments, "bell": bell})


@dataclass(frozen=True)
class ProcessIdentity:
    """A process's pid and its host's boot id (in prefill's `/bootstrap/info`): a peer on
    the same host can watch its end (a pidfd) where the boot ids match."""

    pid: int | None
    boot_id: str | None

    @staticmethod
    def from_json(data: Mapping[str, object]) -> ProcessIdentity:
        """The identity in a JSON object (a field missing or of another type: None)."""
        pid, boot_id = data.get("pid"), data.get("boot_id")
        return ProcessIdentity(
            pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            boot_id if isinstance(boot_id, str) else None,
        )

    def to_json(self) -> dict[str, int | str | None]:
        return {"pid": self.pid, "boot_id": self.boot_id}


@dataclass(frozen=True)
class PrefillInfo:
    """What decode reads of prefill's `/bootstrap/info`: its TP, its KV heads, its process."""

    tp: int
    num_kv_heads: int
    process: ProcessIdentity

    @staticmethod
    def from_json(data: object) -> PrefillInfo:
        if not isinstance(data, dict):
            raise ValueError("prefill's info is a JSON object")
        tp, heads = json_int(data, "tp"), json_int(data, "num_kv_heads")
        return PrefillInfo(tp, heads, ProcessIdentity.from_json(data))


INT_FIELDS = (
    "room",
    "decode_rank",
    "decode_tp",
    "num_tokens",
    "page_size",
    "kv_heads",
    "head_dim",
    "num_layers",
    "elem_bytes",
    "segment_bytes",
)
MAX_TEXT = 1 << 16
MAX_LIST = 1 << 20


def json_int(data: Mapping[str, object], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise ValueError(f"{name} must be a non-negative integer")
    return value


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_LIST:
        raise ValueError(f"{name} must be a list of at most {MAX_LIST} items")
    return value


def _pair(value: Any) -> list[Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("kv_bases must be a list of [k, v] address pairs")
    return value


def segment_from_json(data: Any) -> SegmentRegion:
    if not isinstance(data, dict):
        raise ValueError("a segment region is a JSON object")
    fields = set(SegmentRegion.__dataclass_fields__)
    if set(data) != fields:
        raise ValueError(f"a segment region has exactly the fields {', '.join(sorted(fields))}")
    for name in fields - {"watermark"}:
        json_int(data, name)
    mark = data["watermark"]
    if (
        not isinstance(mark, list)
        or len(mark) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in mark)
    ):
        raise ValueError("watermark must be [round, tail], two non-negative integers")
    return SegmentRegion(**{**data, "watermark": (mark[0], mark[1])})


def notify_prefix(room: int, segment: int, writer: int) -> bytes:
    return f"pd:{room}:{segment}:{writer}|".encode()


def notify_message(room: int, segment: int, writer: int, digests: list[int], nbytes: int) -> bytes:
    return (
        notify_prefix(room, segment, writer)
        + json.dumps({"digests": digests, "bytes": nbytes}).encode()
    )


@dataclass(frozen=True)
class Notified:
    """A notification's body: the writer's digests ([segment][L0.K, L0.V, ...] flat) and
    the bytes it wrote (None where it did not say)."""

    digests: list[int]
    nbytes: int | None


def parse_notify(message: bytes) -> Notified:
    _, _, body = message.partition(b"|")
    value = json.loads(body)
    return Notified(list(value["digests"]), value.get("bytes"))


def json_tensor(value: Any) -> torch.Tensor:
    data = json.dumps(value).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def tensor_json(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode())
