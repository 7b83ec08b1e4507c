"""Head slices for any prefill/decode TP pair, staging layout and segments."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdctl.staging.layout import (
    HeadSlice,
    SegmentTooSmall,
    StagingLayout,
    head_slices,
    plan_segments,
    rank_heads,
    writers_of,
)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "expected"),
    [
        (1, 2, {0: [HeadSlice(0, 0, 0, 2)], 1: [HeadSlice(0, 2, 0, 2)]}),
        (2, 1, {0: [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]}),
        (1, 4, {r: [HeadSlice(0, r, 0, 1)] for r in range(4)}),
        (
            4,
            2,
            {
                0: [HeadSlice(0, 0, 0, 1), HeadSlice(1, 0, 1, 1)],
                1: [HeadSlice(2, 0, 0, 1), HeadSlice(3, 0, 1, 1)],
            },
        ),
        (2, 2, {0: [HeadSlice(0, 0, 0, 2)], 1: [HeadSlice(1, 0, 0, 2)]}),
        # GQA replication on decode: TP 8 over 4 KV heads, two ranks per head.
        (1, 8, {r: [HeadSlice(0, r // 2, 0, 1)] for r in range(8)}),
        # Replication on prefill: each head lives on two prefill ranks; decode ranks spread.
        (
            8,
            2,
            {
                0: [HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 1)],
                1: [HeadSlice(5, 0, 0, 1), HeadSlice(7, 0, 1, 1)],
            },
        ),
    ],
)
def test_head_slices_for_the_named_pairs(prefill_tp, decode_tp, expected) -> None:
    for rank, slices in expected.items():
        assert list(head_slices(4, prefill_tp, decode_tp, rank)) == slices


def test_incompatible_tp_is_refused() -> None:
    with pytest.raises(ValueError, match="TP 3 does not divide 4 KV heads"):
        head_slices(4, 3, 1, 0)
    with pytest.raises(ValueError, match="TP 6 is not a multiple of 4 KV heads"):
        head_slices(4, 1, 6, 0)


tp_sizes = st.sampled_from([1, 2, 4, 8, 16])


@given(st.sampled_from([1, 2, 4, 8]), tp_sizes, tp_sizes)
def test_every_decode_head_comes_from_a_prefill_rank_that_holds_it(
    heads, prefill_tp, decode_tp
) -> None:
    for rank in range(decode_tp):
        wanted = list(rank_heads(heads, decode_tp, rank))
        received: list[int] = []
        for piece in head_slices(heads, prefill_tp, decode_tp, rank):
            held = list(rank_heads(heads, prefill_tp, piece.prefill_rank))
            sent = held[piece.src_head_start : piece.src_head_start + piece.num_heads]
            assert len(sent) == piece.num_heads
            assert wanted[piece.dst_head_start : piece.dst_head_start + piece.num_heads] == sent
            received += sent
        assert received == wanted
    # The prefill view agrees with the decode view.
    for prefill_rank in range(prefill_tp):
        for rank, piece in writers_of(heads, prefill_tp, decode_tp, prefill_rank).items():
            assert piece in head_slices(heads, prefill_tp, decode_tp, rank)


def test_layout_offsets_place_writers_back_to_back() -> None:
    layout = StagingLayout(num_layers=3, head_dim=8, elem_bytes=2, slices=head_slices(4, 2, 1, 0))
    assert layout.num_heads == 4
    assert layout.bytes_per_token() == 2 * 3 * 8 * 2 * 4
    assert layout.block_offset(0, 10) == 0
    assert layout.block_offset(1, 10) == layout.block_bytes(0, 10) == 2 * 3 * 10 * 2 * 8 * 2
    assert layout.region_bytes(10) == layout.block_bytes(0, 10) + layout.block_bytes(1, 10)
    assert layout.writer_index(1) == 1


@given(
    st.integers(0, 300), st.sampled_from([1, 16, 64]), st.integers(1, 4096), st.integers(1, 1 << 20)
)
def test_segments_cover_every_page_once_and_fit(num_pages, page_size, per_token, max_bytes) -> None:
    try:
        segments = plan_segments(num_pages, page_size, per_token, max_bytes)
    except SegmentTooSmall:
        assert per_token * page_size > max_bytes
        return
    covered = [p for s in segments for p in range(s.page_start, s.page_start + s.num_pages)]
    assert covered == list(range(num_pages))
    for segment in segments:
        assert segment.num_pages >= 1 and segment.num_tokens(page_size) * per_token <= max_bytes
