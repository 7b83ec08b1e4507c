"""The mapped write's path (arm, fire, finish) and the observer a benchmark attaches to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.mapped_write import MappedWriter, RoomWrite, StartedWrite
from pdctl.staging.doorbell import DIGESTS, BellBox
from pdctl.staging.kernels import KVSlice, slice_digests
from pdctl.staging.layout import StagingLayout, head_slices
from pdctl.staging.transport import Peer
from tests.serve.kv_registrations import direct_registration

T = TypeVar("T")


# -- arm, fire, finish: the write's path with a stand-in transport that maps a "decode"
# pool of this process (on a GPU, CUDA IPC maps the peer's); the torch path writes, so
# the host tells decode (the device rings only from the Triton launch, tests/staging).


class MappingTransport:
    """`mapped_view` over a pool of this process; notifications recorded."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.notices: list[bytes] = []

    def mapped_view(self, peer: Peer, address: int) -> torch.Tensor:
        whole = self.pool.kv.view(-1).view(torch.uint8)
        return whole[address - self.pool.kv.data_ptr() :]

    def notify(self, peer: Peer, notice: bytes) -> None:
        self.notices.append(notice)


class Recorder:
    """An observer that records what it ran and heard."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def arming(self, arm: Callable[[], T]) -> T:
        self.calls.append("arm")
        return arm()

    def firing(self, fire: Callable[[], T]) -> T:
        self.calls.append("fire")
        return fire()

    def finished(self, started: StartedWrite, told: str, inline: bool, *seconds: float) -> None:
        self.calls.append((started.room, told, inline))


def _mapped_room(bell: bool, observer: Any = None):  # type: ignore[no-untyped-def]
    prefill = KVPool(2, 64, 2, 8, 4, torch.float32, torch.device("cpu"))
    decode = KVPool(2, 64, 2, 8, 4, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    prefill.kv.copy_(torch.randn(prefill.kv.shape, generator=generator))
    transport = MappingTransport(decode)
    writer = (
        MappedWriter(0, prefill, transport)  # type: ignore[arg-type]
        if observer is None
        else MappedWriter(0, prefill, transport, observer=observer)  # type: ignore[arg-type]
    )
    layout = StagingLayout(2, 8, 4, head_slices(2, 1, 1, 0))
    box = BellBox(4, 64) if bell else None
    bell_offer = None if box is None else proto.BellOffer(box.info, [box.ticket()])  # type: ignore[list-item]
    registration = direct_registration(decode, 5, [9, 3, 6], 12, bell=bell_offer)
    peer = Peer("decode", "local", [])
    return prefill, decode, transport, writer, layout, registration, peer, box


@pytest.mark.parametrize("bell", [True, False])
def test_an_armed_write_lands_when_fired_and_decode_is_told(bell: bool) -> None:
    prefill, decode, transport, writer, layout, registration, peer, box = _mapped_room(bell)
    pages = [2, 7, 4]
    armed = writer.arm(RoomWrite(5, pages, registration, layout, 0, peer))
    assert armed is not None
    assert torch.count_nonzero(decode.kv) == 0  # armed: nothing written yet
    started = armed.fire()
    seconds = writer.finish(started)
    assert seconds >= 0 and started.done_s == seconds
    for layer in range(2):
        for source, target in zip(pages, registration.pages, strict=True):
            rows, into = slice(source * 4, source * 4 + 4), slice(target * 4, target * 4 + 4)
            assert torch.equal(decode.k_buffers[layer][into], prefill.k_buffers[layer][rows])
            assert torch.equal(decode.v_buffers[layer][into], prefill.v_buffers[layer][rows])
    every_head = KVSlice(0, 2, 4)
    expected = slice_digests(prefill.k_buffers, prefill.v_buffers, pages, [(0, 3)], every_head)[0]
    if box is not None:  # rung from the host (the torch path wrote): decode reads the digests
        assert registration.bell is not None
        rung = box.wait(registration.bell.tickets[0], 1.0)
        assert rung is not None and rung[0] == DIGESTS
        assert [int(v) & ((1 << 64) - 1) for v in rung[1]] == expected
        assert transport.notices == []
        box.close()
    else:
        assert len(transport.notices) == 1
        assert proto.parse_notify(transport.notices[0]).digests == expected


def test_an_observer_runs_the_arm_and_the_launch_and_hears_the_write() -> None:
    recorder = Recorder()
    _, _, transport, writer, layout, registration, peer, _ = _mapped_room(False, recorder)
    armed = writer.arm(RoomWrite(5, [2, 7, 4], registration, layout, 0, peer))
    assert armed is not None
    writer.finish(armed.fire(), inline=True)
    assert recorder.calls == ["arm", "fire", (5, "notification", True)]
    assert len(transport.notices) == 1
