"""Decode's doorbells in the PD protocol (`serve/pd/bells.py`): tickets for a room's
writers, a ring's values as the digests a notification would carry, tickets back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.pd import bells as pd_bells
from pdctl.serve.pd import protocol as proto
from pdctl.serve.pd.bells import Bells, Ringers
from pdctl.staging.doorbell import DIGESTS, SUMS, BellBox
from pdctl.staging.kernels import slice_digests
from pdctl.staging.layout import StagingLayout, head_slices, plan_segments
from pdctl.staging.transport import TransportConfig, create_transport


def _pool() -> KVPool:
    kv = KVPool(3, 96, 4, 8, 4, torch.bfloat16, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**15), 2**15, kv.kv.shape, dtype=torch.int16, generator=generator)
    kv.kv.copy_(bits.view(torch.bfloat16))
    return kv


def _sums(kv: KVPool, pages: list[int], plan, heads: tuple[int, int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Each segment's and buffer's weighted int32-word sums, as the device computes them."""
    start, count = heads
    out = []
    for segment in plan:
        chunk = pages[segment.page_start : segment.page_start + segment.num_pages]
        rows = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in chunk])
        for buffer in [b for pair in zip(kv.k_buffers, kv.v_buffers, strict=True) for b in pair]:
            words = buffer[rows, start : start + count].contiguous().view(torch.int32)
            values = words.reshape(-1).to(torch.int64).numpy().astype(np.uint64)
            weights = np.arange(len(values), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
            with np.errstate(over="ignore"):
                out.append((values * weights).sum(dtype=np.uint64))
    return np.asarray(out, dtype=np.uint64).view(np.int64)


@pytest.mark.parametrize("decode_rank", [0, 1])
def test_a_rings_sums_become_the_digests_a_notification_carries(decode_rank: int) -> None:
    kv = _pool()
    layout = StagingLayout(3, 8, 2, head_slices(4, 1, 2, decode_rank))  # TP1 -> TP2
    piece = layout.slices[0]
    pages = [5, 1, 9, 3, 7]
    plan = plan_segments(len(pages), 4, layout.bytes_per_token(), 2 * 4 * layout.bytes_per_token())
    assert len(plan) == 3  # two pages a segment
    with BellBox(2, 64) as box:
        bells = Bells(box, kv)
        sums = _sums(kv, pages, plan, (piece.src_head_start, piece.num_heads))
        got = bells.digests(SUMS, sums, piece, plan)
        segments = [(s.page_start, s.num_pages) for s in plan]
        expected = slice_digests(kv.k_buffers, kv.v_buffers, pages, segments, piece.source(4))
        assert got == [d for part in expected for d in part]
        assert bells.digests(DIGESTS, np.array([-1, 5]), piece, plan) == [2**64 - 1, 5]
        with pytest.raises(ValueError, match="sums for"):
            bells.digests(SUMS, sums[:-1], piece, plan)


def test_offers_fit_the_box_and_tickets_come_back() -> None:
    with BellBox(3, 2 * 3 * 4) as box:  # three slots of four segments of three layers
        bells = Bells(box, _pool())  # three layers
        two_writers = StagingLayout(3, 8, 2, head_slices(4, 2, 1, 0))
        assert len(two_writers.slices) == 2
        assert bells.offer(two_writers, 5) is None  # five segments do not fit a slot
        offer = bells.offer(two_writers, 4)
        assert offer is not None and len(offer.tickets) == 2 and box.free_slots == 1
        assert bells.offer(two_writers, 1) is None and box.free_slots == 1  # none half-taken
        bells.give_back(offer, read={0})  # writer 1 never rang: its slot rests
        assert box.free_slots == 2
        again = proto.BellOffer.from_json(
            {"box": offer.box.to_json(), "tickets": [{"slot": 0, "seq": 3}]}
        )
        assert again.tickets[0].seq == 3
        with pytest.raises(ValueError, match="outside the box"):
            proto.BellOffer.from_json(
                {"box": offer.box.to_json(), "tickets": [{"slot": 3, "seq": 1}]}
            )


def test_only_pdctls_own_transport_offers_doorbells() -> None:
    kv = _pool()
    tcp = create_transport("tcp", TransportConfig("decode"))
    try:
        found = Bells.for_receiver(tcp, kv, "decode")
        assert found is not None and found.box.capacity == 2 * 3 * pd_bells.MAX_SEGMENTS
        found.box.close()
        assert Bells.for_receiver(tcp, kv, "decode", enabled=False) is None
    finally:
        tcp.close()


def test_a_box_that_cannot_be_opened_is_remembered(caplog: pytest.LogCaptureFixture) -> None:
    with BellBox(1, 4) as box:
        ringers = Ringers()
        assert ringers.open(box.info) is ringers.open(box.info) is not None
        wrong = type(box.info)(box.info.path, box.info.nonce + 1, 1, box.info.slot_words)
        with caplog.at_level("INFO", logger="pdctl.serve"):
            assert ringers.open(wrong) is None and ringers.open(wrong) is None
        assert caplog.text.count("cannot be opened") == 1
        assert Ringers(enabled=False).open(box.info) is None  # off: every writer notifies
