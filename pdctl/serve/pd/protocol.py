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
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pdctl.staging.allocator import Region, Watermark

DIRECT_SEGMENT = -1  # the segment index of a direct (unstaged) page write


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Registration:
        segments = [
            SegmentRegion(**{**s, "watermark": tuple(s["watermark"])})
            for s in data.get("segments", [])
        ]
        return Registration(**{**data, "segments": segments})


def notify_prefix(room: int, segment: int, writer: int) -> bytes:
    return f"pd:{room}:{segment}:{writer}|".encode()


def error_prefix(room: int) -> bytes:
    return f"pd:{room}:error|".encode()


def notify_message(room: int, segment: int, writer: int, digests: list[int], nbytes: int) -> bytes:
    return (
        notify_prefix(room, segment, writer)
        + json.dumps({"digests": digests, "bytes": nbytes}).encode()
    )


def parse_notify(message: bytes) -> dict[str, Any]:
    _, _, body = message.partition(b"|")
    value: dict[str, Any] = json.loads(body)
    return value


def json_tensor(value: Any) -> torch.Tensor:
    data = json.dumps(value).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def tensor_json(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode())
