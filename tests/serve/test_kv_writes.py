"""The ways a room's KV goes to a decode rank (`writes.KvWrite`) and the faults that
wrap them, on CPU in one process: a stand-in transport copies descriptors with
memmove (and maps the "decode" pool where asked), so what landed and what decode
was told can be compared with what prefill holds. `tests/serve/test_pd.py` runs the
same ways between real processes."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.faults import RoomFaults
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.bells import Ringers
from pdctl.serve.pd.direct import DescribedWrite, DirectWrite
from pdctl.serve.pd.mapped_write import MappedWriter
from pdctl.serve.pd.room_state import RoomSnapshot, RoomWait
from pdctl.serve.pd.staged import StagedWrite, StagingBuffers
from pdctl.serve.pd.waits import RoomWaits
from pdctl.serve.pd.write_faults import CorruptDescribed, CorruptStaged, LandLate, RoomWays
from pdctl.serve.pd.writes import KvWrite, Link, RoomWrite, SendClock
from pdctl.staging.digest import block_digests
from pdctl.staging.kernels import KVSlice, slice_digests
from pdctl.staging.layout import StagingLayout, head_slices
from pdctl.staging.transport import Peer
from pdctl.staging.transport.values import notice_bytes
from tests.serve.kv_registrations import direct_registration

PAGES, THEIRS = [2, 7, 4], [9, 3, 6]  # prefill's pages of the room, decode's


class CopyingTransport:
    """`write` copies each descriptor (memmove); `mapped_view` maps `decode` if asked."""

    RINGS_BELLS = False

    def __init__(self, decode: KVPool, maps: bool) -> None:
        self.decode, self.maps = decode, maps
        self.events: list[str] = []  # "write <n bytes>", "notice", "land"
        self.notices: list[bytes] = []

    def register_tensor(self, tensor: torch.Tensor) -> None:
        pass

    def write(
        self,
        peer: Peer,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        *,
        notify: bytes | Callable[[], bytes] | None = None,
    ) -> None:
        for s, d, n in zip(src, dst, lengths, strict=True):
            ctypes.memmove(int(d), int(s), int(n))
        self.events.append(f"write {sum(int(n) for n in lengths)}")
        message = notice_bytes(notify)
        if message is not None:
            self.notify(peer, message)

    def mapped_view(self, peer: Peer, address: int) -> torch.Tensor | None:
        if not self.maps:
            return None
        whole = self.decode.kv.view(-1).view(torch.uint8)
        return whole[address - self.decode.kv.data_ptr() :]

    def notify(self, peer: Peer, notice: bytes) -> None:
        self.events.append("notice")
        self.notices.append(notice)


def _pools() -> tuple[KVPool, KVPool]:
    prefill = KVPool(2, 64, 2, 8, 4, torch.float32, torch.device("cpu"))
    decode = KVPool(2, 64, 2, 8, 4, torch.float32, torch.device("cpu"))
    prefill.kv.copy_(torch.randn(prefill.kv.shape, generator=torch.Generator().manual_seed(5)))
    return prefill, decode


def _registration(
    decode: KVPool, mode: str, segments: list[proto.SegmentRegion]
) -> proto.Registration:
    """Decode rank 0 of TP 1 registers room 5: direct (its pages and pool's addresses)
    or staged (the ring regions it offers)."""
    # two pages a segment: the room is cut in two
    direct = direct_registration(decode, 5, THEIRS, 12, segment_bytes=2048)
    if mode == "direct":
        return direct
    return replace(direct, mode=mode, pages=[], kv_bases=[], segments=segments)


def _waits(reg: proto.Registration) -> RoomWaits:
    def snapshot(room: int, wait: float, condition: RoomWait) -> RoomSnapshot:
        return RoomSnapshot(room, True, None, None, {reg.decode_rank: reg})

    return RoomWaits(snapshot, 1.0, 1.0)


def _target(reg: proto.Registration) -> RoomWrite:
    layout = StagingLayout(2, 8, 4, head_slices(2, 1, 1, 0))
    return RoomWrite(5, PAGES, reg, layout, 0, Peer("decode", "local", []))


def _landed_exactly(prefill: KVPool, decode: KVPool) -> bool:
    return all(
        torch.equal(theirs[t * 4 : t * 4 + 4], ours[s * 4 : s * 4 + 4])
        for ours, theirs in [
            *zip(prefill.k_buffers, decode.k_buffers, strict=True),
            *zip(prefill.v_buffers, decode.v_buffers, strict=True),
        ]
        for s, t in zip(PAGES, THEIRS, strict=True)
    )


def _direct(maps: bool) -> tuple[KVPool, KVPool, CopyingTransport, DirectWrite, RoomWrite]:
    prefill, decode = _pools()
    transport = CopyingTransport(decode, maps)
    mapped = MappedWriter(0, prefill, transport)  # type: ignore[arg-type]
    direct = DirectWrite(mapped, DescribedWrite(0, prefill, Ringers()))
    return prefill, decode, transport, direct, _target(_registration(decode, "direct", []))


@pytest.mark.parametrize("maps", [True, False], ids=["mapped", "by-descriptors"])
def test_a_direct_write_lands_the_pages_and_tells_decode_their_digests(maps: bool) -> None:
    prefill, decode, transport, direct, target = _direct(maps)
    written = direct.write(target, Link(transport, target.peer), SendClock())  # type: ignore[arg-type]
    assert written.nbytes == 3 * 4 * 2 * 2 * 2 * 8 * 4 and written.segments == 0
    assert _landed_exactly(prefill, decode)
    # the mapped write launches, then notifies; by descriptors the notice rides the write
    assert transport.events == (["notice"] if maps else [f"write {written.nbytes}", "notice"])
    segments, every_head = [(0, 2), (2, 1)], KVSlice(0, 2, 4)
    expected = slice_digests(prefill.k_buffers, prefill.v_buffers, PAGES, segments, every_head)
    assert proto.parse_notify(transport.notices[0]).digests == [
        d for part in expected for d in part
    ]


def test_corrupt_kv_around_a_direct_write_flips_its_first_byte_after_the_digests() -> None:
    prefill, decode, transport, direct, target = _direct(maps=True)  # corrupt never maps
    staging = StagingBuffers(transport, 4096, 1, torch.device("cpu"))  # type: ignore[arg-type]
    corrupt = CorruptDescribed(direct.described, staging)
    corrupt.write(target, Link(transport, target.peer), SendClock())  # type: ignore[arg-type]
    assert transport.events[1:] == ["write 1", "notice"]  # the flipped byte carries the notice
    assert not _landed_exactly(prefill, decode)
    first = decode.k_buffers[0][THEIRS[0] * 4].flatten().view(torch.uint8)[0]
    sent = prefill.k_buffers[0][PAGES[0] * 4].flatten().view(torch.uint8)[0]
    assert int(first) == int(sent) ^ 0x5A


def _staged(corrupt: bool) -> tuple[torch.Tensor, CopyingTransport, list[int]]:
    prefill, decode = _pools()
    ring = torch.zeros(2 * 2048, dtype=torch.uint8)
    segments = [
        proto.SegmentRegion(
            i, 2 * i, 2 - i, ring.data_ptr() + 2048 * i, 2048 * i, 2048, 4096, (0, 0)
        )
        for i in (0, 1)
    ]
    reg = _registration(decode, "staging", segments)
    transport = CopyingTransport(decode, maps=False)
    staged: KvWrite = StagedWrite(
        0, prefill, StagingBuffers(transport, 2048, 1, torch.device("cpu")), _waits(reg)
    )  # type: ignore[arg-type]
    if corrupt:
        staged = CorruptStaged(staged)
    target = _target(reg)
    written = staged.write(target, Link(transport, target.peer), SendClock())  # type: ignore[arg-type]
    assert (written.nbytes, written.segments) == (3 * 1024, 2)
    sent = [d for notice in transport.notices for d in proto.parse_notify(notice).digests]
    return ring, transport, sent


def test_a_staged_write_lands_each_segment_in_its_region_with_its_digests() -> None:
    ring, transport, sent = _staged(corrupt=False)
    assert transport.events == ["write 2048", "notice", "write 1024", "notice"]
    assert sent == block_digests(ring[:2048], 2) + block_digests(ring[2048:3072], 2)


def test_corrupt_kv_around_a_staged_write_flips_segment_0_after_its_digests() -> None:
    ring, _, sent = _staged(corrupt=True)
    assert sent[:4] != block_digests(ring[:2048], 2)  # segment 0: the mismatch decode finds
    assert sent[4:] == block_digests(ring[2048:3072], 2)


def test_a_late_write_waits_for_the_room_to_close_then_lands_once() -> None:
    prefill, decode, transport, direct, target = _direct(maps=False)
    closes: list[RoomWait] = []

    def snapshot(room: int, wait: float, condition: RoomWait) -> RoomSnapshot:
        closes.append(condition)
        transport.events.append("land")
        return RoomSnapshot(room, True, "failed: decode gave up", None, {})

    late = LandLate(direct, RoomWaits(snapshot, 1.0, 1.0), 0.01)
    late.write(target, Link(transport, target.peer), SendClock())  # type: ignore[arg-type]
    assert closes == [RoomWait.closed()] and transport.events[0] == "land"
    assert transport.events[1:] == [f"write {3 * 1024}", "notice"] and _landed_exactly(
        prefill, decode
    )


def test_a_rooms_ways_are_its_faults() -> None:
    plain, corrupt = {"direct": object()}, {"direct": object()}
    ways = RoomWays(plain, corrupt, RoomWaits(lambda *_: RoomSnapshot.empty(0), 1.0, 1.0))  # type: ignore[arg-type]
    assert ways.enter(RoomFaults()) is plain
    assert ways.enter(RoomFaults(corrupt_kv=True)) is corrupt
    late = ways.enter(RoomFaults(late_write_s=0.5))
    assert isinstance(late["direct"], LandLate) and late["direct"].inner is plain["direct"]
