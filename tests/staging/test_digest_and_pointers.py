"""Digests detect corruption and placement; pointers never lose bit 63; direct-write
descriptors match a brute-force construction and move the right bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.staging.descriptors import (
    KVRows,
    as_u64,
    block_address,
    direct_descriptors,
    head_slice_descriptors,
    kv_bases,
    offset_address,
    page_descriptors,
    page_runs,
    pointer_table,
    region_descriptors,
    unsigned_ptr,
    xpu_pointer_type,
)
from pdctl.staging.digest import block_digests, chunk_digests, first_mismatch
from pdctl.staging.layout import HeadSlice, StagingLayout, head_slices
from tests.staging.kv_factory import as_bits, random_kv

HIGH = 0xFF00_0000_0000_1000  # an XPU kernel-space style address, bit 63 set


def test_digest_is_per_layer_and_kv_and_names_the_first_change() -> None:
    block = torch.randint(0, 256, (3 * 2 * 1000,), dtype=torch.uint8)
    sent = block_digests(block, num_layers=3)
    assert len(sent) == 6 and len(set(sent)) == 6
    corrupted = block.clone()
    corrupted[2 * 1000 + 17] ^= 0x01  # layer 1, K
    assert first_mismatch(sent, block_digests(corrupted, 3)) == (1, "K")
    assert first_mismatch(sent, block_digests(block.clone(), 3)) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4095), st.integers(1, 255), st.sampled_from([4096, 4094, 4093]))
def test_any_single_byte_change_is_detected(position, flip, size) -> None:
    data = torch.arange(size, dtype=torch.int64).mul(2654435761).remainder(256).to(torch.uint8)
    if position >= size:
        return
    changed = data.clone()
    changed[position] ^= flip
    assert chunk_digests(data, 1) != chunk_digests(changed, 1)


def test_swapped_words_are_detected() -> None:
    data = torch.arange(64, dtype=torch.int32).view(torch.uint8)
    swapped = data.view(torch.int32).clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert chunk_digests(data, 1) != chunk_digests(swapped.view(torch.uint8), 1)


def test_pointers_with_bit_63_survive() -> None:
    assert unsigned_ptr(-1) == 2**64 - 1
    array = as_u64([HIGH, -4096, 17])
    assert array.dtype == np.uint64 and int(array[0]) == HIGH and int(array[1]) == 2**64 - 4096
    src, dst, lengths = region_descriptors(
        HIGH, HIGH + 2**20, np.array([0, 64]), np.array([64, 64])
    )
    assert [int(x) for x in src] == [HIGH, HIGH + 64]
    assert int(dst[1]) == HIGH + 2**20 + 64 and lengths.dtype == np.uint64
    s, d, _ = page_descriptors(
        [HIGH, HIGH + 8192], [2**63, 2**63 + 8192], np.array([3, 1]), np.array([0, 2]), 256
    )
    assert [int(x) for x in s] == [HIGH + 768, HIGH + 256, HIGH + 8192 + 768, HIGH + 8192 + 256]
    assert [int(x) for x in d] == [2**63, 2**63 + 512, 2**63 + 8192, 2**63 + 8192 + 512]
    assert (
        xpu_pointer_type(HIGH) == "XPU-kernel-space" and xpu_pointer_type(4096) == "XPU-user-space"
    )


def test_pointer_table_keeps_the_bit_pattern() -> None:
    class Fake:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def data_ptr(self) -> int:
            return self.ptr

    table = pointer_table([Fake(HIGH), Fake(4096)], torch.device("cpu"))  # type: ignore[list-item]
    assert table.dtype == torch.int64
    assert int(table[0]) & (2**64 - 1) == HIGH and int(table[1]) == 4096


def test_ring_and_block_addresses_are_unsigned() -> None:
    assert offset_address(HIGH, 4096) == HIGH + 4096
    assert offset_address(-4096, 4096) == 0  # a signed pointer is read as unsigned first
    layout = StagingLayout(3, 8, 2, head_slices(4, 2, 1, 0))  # two writers, two heads each
    assert block_address(HIGH, layout, 0, 16) == HIGH
    assert block_address(HIGH, layout, 1, 16) == HIGH + 2 * 3 * 16 * 8 * 2 * 2


def brute_force(src_bases, dst_bases, src_pages, dst_pages, rows):
    """One descriptor per buffer and token row, spelled out."""
    page, head_bytes, piece = rows.page_size, rows.head_bytes, rows.piece
    src_heads, dst_heads = rows.src_heads, rows.dst_heads
    found = []
    for src_base, dst_base in zip(src_bases, dst_bases, strict=True):
        for src_page, dst_page in zip(src_pages, dst_pages, strict=True):
            for i in range(page):
                src_row, dst_row = src_page * page + i, dst_page * page + i
                src = (src_base + (src_row * src_heads + piece.src_head_start) * head_bytes) % 2**64
                dst = (dst_base + (dst_row * dst_heads + piece.dst_head_start) * head_bytes) % 2**64
                found.append((src, dst, piece.num_heads * head_bytes))
    return found


# (source heads, destination heads, the slice): replicated, split, merged, offset
HEAD_CASES = [
    (4, 2, HeadSlice(0, 2, 0, 2)),
    (2, 4, HeadSlice(1, 0, 2, 2)),
    (4, 1, HeadSlice(0, 3, 0, 1)),
    (1, 4, HeadSlice(3, 0, 3, 1)),
    (8, 4, HeadSlice(0, 1, 1, 3)),
]


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(HEAD_CASES),
    st.lists(st.integers(0, 63), min_size=1, max_size=6, unique=True),
    st.integers(1, 4),
    st.sampled_from([HIGH, 4096, 2**63]),
)
def test_head_slice_descriptors_match_a_brute_force_construction(heads, pages, page, base) -> None:
    src_heads, dst_heads, piece = heads
    layers, head_bytes = 3, 64
    pool = 64 * page * max(src_heads, dst_heads) * head_bytes
    src_bases = [base + n * pool for n in range(2 * layers)]
    dst_bases = [2**62 + n * pool for n in range(2 * layers)]
    dst_pages = [(p * 7 + 3) % 64 for p in pages]
    rows = KVRows(page, head_bytes, src_heads, dst_heads, piece)
    src, dst, lengths = head_slice_descriptors(src_bases, dst_bases, pages, dst_pages, rows)
    assert src.dtype == dst.dtype == lengths.dtype == np.uint64
    built = list(zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True))
    expected = brute_force(src_bases, dst_bases, pages, dst_pages, rows)
    assert built == expected


@pytest.mark.parametrize(
    ("src_heads", "dst_heads", "piece"),
    [
        (4, 2, HeadSlice(0, 2, 0, 2)),  # prefill TP1 -> decode TP2 rank 1: token rows
        (2, 4, HeadSlice(1, 0, 2, 2)),  # prefill TP2 rank 1 -> decode TP1: token rows
        (2, 2, HeadSlice(0, 0, 0, 2)),  # equal TP: whole pages
    ],
)
def test_direct_descriptors_move_the_head_slice_into_the_peer_pages(
    src_heads, dst_heads, piece
) -> None:
    page, layers, dim = 4, 2, 8
    src_k, src_v = random_kv(layers, 16 * page, src_heads, dim, torch.bfloat16, seed=1)
    dst_k, dst_v = random_kv(layers, 16 * page, dst_heads, dim, torch.bfloat16, seed=2)
    src_pages, dst_pages = [3, 0, 7], [5, 11, 2]
    rows = KVRows(page, dim * 2, src_heads, dst_heads, piece)  # bf16: 2 bytes an element
    bases = (kv_bases(src_k, src_v), kv_bases(dst_k, dst_v))
    src, dst, lengths = direct_descriptors(*bases, src_pages, dst_pages, rows)
    whole_pages = src_heads == dst_heads == piece.num_heads
    assert len(src) == 2 * layers * len(src_pages) * (1 if whole_pages else page)
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        ctypes.memmove(d, s, n)  # what a transport does with them
    src_rows = torch.tensor([p * page + i for p in src_pages for i in range(page)])
    dst_rows = torch.tensor([p * page + i for p in dst_pages for i in range(page)])
    src_heads_slice = slice(piece.src_head_start, piece.src_head_start + piece.num_heads)
    dst_heads_slice = slice(piece.dst_head_start, piece.dst_head_start + piece.num_heads)
    for sent, landed in zip([*src_k, *src_v], [*dst_k, *dst_v], strict=True):
        assert torch.equal(
            as_bits(landed)[dst_rows, dst_heads_slice], as_bits(sent)[src_rows, src_heads_slice]
        )


def test_page_runs_join_pages_consecutive_on_both_sides() -> None:
    src_first, dst_first, lengths = page_runs(np.array([3, 4, 5, 9, 10]), np.array([7, 8, 9, 0, 2]))
    assert src_first.tolist() == [3, 9, 10] and dst_first.tolist() == [7, 0, 2]
    assert lengths.tolist() == [3, 1, 1]
    s, d, n = page_descriptors([1000, 9000], [50000, 90000], np.array([3, 4]), np.array([7, 8]), 16)
    assert s.tolist() == [1048, 9048] and d.tolist() == [50112, 90112] and n.tolist() == [32, 32]


@settings(max_examples=60, deadline=None)
@given(
    order=st.permutations(list(range(12))),
    count=st.integers(1, 12),
    shift=st.integers(0, 4),
)
def test_page_descriptors_in_runs_move_what_page_by_page_moves(order, count, shift) -> None:
    """Whatever the runs, the descriptors write exactly each page into its peer page."""
    page_bytes, pool_pages = 8, 16
    src_pages = np.array(sorted(order[:count]) if shift % 2 else order[:count])
    dst_pages = (src_pages + shift) % pool_pages
    source = np.arange(2 * pool_pages * page_bytes, dtype=np.uint8)
    target = np.zeros_like(source)
    bases = [source.ctypes.data, source.ctypes.data + pool_pages * page_bytes]
    peer = [target.ctypes.data, target.ctypes.data + pool_pages * page_bytes]
    src, dst, lengths = page_descriptors(bases, peer, src_pages, dst_pages, page_bytes)
    assert len(src) <= 2 * count
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        ctypes.memmove(d, s, n)
    expected = np.zeros_like(source)
    for buffer in range(2):
        for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            at, to = (buffer * pool_pages + s) * page_bytes, (buffer * pool_pages + d) * page_bytes
            expected[to : to + page_bytes] = source[at : at + page_bytes]
    assert np.array_equal(target, expected)


def test_kv_bases_interleave_k_and_v_per_layer() -> None:
    k, v = random_kv(2, 8, 1, 4, torch.float32, seed=3)
    assert kv_bases(k, v) == [unsigned_ptr(t.data_ptr()) for t in (k[0], v[0], k[1], v[1])]
