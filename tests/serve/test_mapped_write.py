"""The mapped write's host-side accounting: the garbage collector's clock and the
enqueue profile a server logs (PDCTL_WRITE_PROFILE)."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import mapped_write
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.mapped_write import EnqueueProfile, GcClock, MappedWriter, RoomWrite
from pdctl.staging.doorbell import DIGESTS, BellBox
from pdctl.staging.kernels import page_digests
from pdctl.staging.layout import StagingLayout, head_slices
from pdctl.staging.transport import Peer

BUSY = sum(i * i for i in range(20_000))


def _busy_enqueue_part() -> int:
    return sum(i * i for i in range(20_000))


def _another_threads_work() -> None:
    for _ in range(50):
        sum(range(1000))
        time.sleep(0.001)


def test_gc_clock_counts_this_threads_collections() -> None:
    clock = GcClock()
    clock.install()
    clock.install()  # once only
    try:
        assert gc.callbacks.count(clock._callback) == 1
        before = clock.seconds()
        for _ in range(3):
            gc.collect()
        assert clock.seconds() > before
    finally:
        gc.callbacks.remove(clock._callback)


def test_enqueue_profile_logs_the_functions_after_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    profile = EnqueueProfile(2)
    other = threading.Thread(target=_another_threads_work)
    with caplog.at_level(logging.INFO, logger="pdctl.serve"):
        assert profile.run(_busy_enqueue_part) == BUSY
        assert "enqueue profile" not in caplog.text  # one of two so far
        other.start()
        assert profile.run(_busy_enqueue_part) == BUSY
        other.join()
        assert profile.run(_busy_enqueue_part) == BUSY  # past its count: unprofiled
    reports = [r for r in caplog.records if "enqueue profile" in r.getMessage()]
    assert len(reports) == 1
    text = reports[0].getMessage()
    assert "_busy_enqueue_part" in text
    assert "_another_threads_work" not in text  # only the calling thread's calls
    assert "function calls" in text
    assert profile.left == 0


def test_enqueue_profile_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    profile = EnqueueProfile(0)
    with caplog.at_level(logging.INFO, logger="pdctl.serve"):
        assert profile.run(_busy_enqueue_part) == BUSY
    assert caplog.text == "" and profile.stats is None


@pytest.mark.parametrize(("raw", "count"), [("", 0), ("0", 0), ("5", 5), ("-3", 0), ("x", 0)])
def test_write_profile_count_parsed(raw: str, count: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdctl.serve"):
        assert mapped_write._profiled_count(raw) == count
    assert ("not a count" in caplog.text) == (raw == "x")


def test_a_profiled_method_gets_its_arguments_and_gives_its_result() -> None:
    class Writer:
        def __init__(self) -> None:
            self.profile = EnqueueProfile(1)

        @mapped_write._profiled
        def start(self, room: int, pages: list[int], *, peer: str = "") -> tuple:
            return room, pages, peer

    writer = Writer()
    assert writer.start(7, [1, 2], peer="decode") == (7, [1, 2], "decode")  # profiled
    assert writer.profile.left == 0 and writer.profile.stats is not None
    assert writer.start(8, []) == (8, [], "")  # past the count


# -- arm, fire, finish: the write's path with a stand-in transport that maps a "decode"
# pool of this process (on a GPU, CUDA IPC maps the peer's); the torch path writes, so
# the host tells decode (the device rings only from the Triton launch, tests/staging).


class MappingTransport:
    """`mapped_view` over a pool of this process; notifications recorded."""

    def __init__(self, pool: KVPool) -> None:
        self.pool, self.notices = pool, []

    def mapped_view(self, peer: Peer, address: int) -> torch.Tensor:
        whole = self.pool.kv.view(-1).view(torch.uint8)
        return whole[address - self.pool.kv.data_ptr() :]

    def notify(self, peer: Peer, notice: bytes) -> None:
        self.notices.append(notice)


def _mapped_room(bell: bool):  # type: ignore[no-untyped-def]
    prefill = KVPool(2, 64, 2, 8, 4, torch.float32, torch.device("cpu"))
    decode = KVPool(2, 64, 2, 8, 4, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    prefill.kv.copy_(torch.randn(prefill.kv.shape, generator=generator))
    transport = MappingTransport(decode)
    writer = MappedWriter(0, prefill, transport)  # type: ignore[arg-type]
    layout = StagingLayout(2, 8, 4, head_slices(2, 1, 1, 0))
    box = BellBox(4, 64) if bell else None
    registration = proto.Registration(
        room=5, decode_rank=0, decode_tp=1, decode_name="decode", transport="", num_tokens=12,
        page_size=4, mode="direct", kv_heads=2, head_dim=8, num_layers=2, elem_bytes=4,
        segment_bytes=1 << 20, pages=[9, 3, 6],
        kv_bases=[[k.data_ptr(), v.data_ptr()] for k, v in zip(decode.k_buffers,
                                                              decode.v_buffers, strict=True)],
        bell=None if box is None else proto.BellOffer(box.info, [box.ticket()]),  # type: ignore[list-item]
    )  # fmt: skip
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
    expected = page_digests(
        prefill.k_buffers, prefill.v_buffers, pages, [(0, 3)], head_start=0, num_heads=2,
        page_size=4,
    )[0]  # fmt: skip
    if box is not None:  # rung from the host (the torch path wrote): decode reads the digests
        assert registration.bell is not None
        rung = box.wait(registration.bell.tickets[0], 1.0)
        assert rung is not None and rung[0] == DIGESTS
        assert [int(v) & ((1 << 64) - 1) for v in rung[1]] == expected
        assert transport.notices == []
        box.close()
    else:
        assert len(transport.notices) == 1
        assert proto.parse_notify(transport.notices[0])["digests"] == expected
