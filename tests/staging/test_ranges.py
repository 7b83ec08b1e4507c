"""Region lookups and the ranges kernel: what a scattered write's device half rests on.

`RegionIndex.locate` is checked against a brute-force scan on generated region sets
(overlaps included) and range lists; `copy_ranges` (the Triton kernel, interpreted on
the CPU) against a byte-by-byte reference, for every word width.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.staging.transport.base import MemoryRegion, RegionIndex


def _scan(regions: list[MemoryRegion], ptr: int, length: int) -> set[int]:
    return {i for i, r in enumerate(regions) if r.contains(ptr, length)}


@settings(max_examples=150, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 800)), min_size=0, max_size=12),
    ranges=st.lists(st.tuples(st.integers(0, 6000), st.integers(1, 900)), min_size=1, max_size=40),
    high=st.booleans(),
)
def test_locate_agrees_with_a_scan(spans, ranges, high) -> None:
    base = (1 << 63) if high else 0x1000  # device pointers may set bit 63
    regions = [MemoryRegion(base + start, length) for start, length in spans]
    index = RegionIndex(regions)
    ptrs = np.array([base + p for p, _ in ranges], dtype=np.uint64)
    lengths = np.array([n for _, n in ranges], dtype=np.uint64)
    found = index.locate(ptrs, lengths)  # few ranges: Python ints; many: numpy
    for k, (p, n) in enumerate(ranges):
        holders = _scan(regions, base + p, n)
        assert (int(found[k]) in holders) if holders else found[k] == -1
    for repeat in (1, 3):  # the same ranges as one long list take the numpy path
        many = index.locate(np.tile(ptrs, 10 * repeat), np.tile(lengths, 10 * repeat))
        assert [(int(f) >= 0) for f in many[: len(ranges)]] == [(int(f) >= 0) for f in found]


def test_a_range_ending_past_the_top_of_memory_is_outside() -> None:
    top = (1 << 64) - 4096
    index = RegionIndex([MemoryRegion(top, 4096)])
    ptrs = np.array([top + 4000] * 10, dtype=np.uint64)
    lengths = np.array([200] * 10, dtype=np.uint64)  # would wrap past 2**64
    assert (index.locate(ptrs, lengths) == -1).all()
    assert (index.locate(ptrs[:1], lengths[:1]) == -1).all()


@pytest.mark.parametrize("align", [8, 4, 2, 1])
def test_copy_ranges_is_bit_exact_for_every_word_width(align: int) -> None:
    from pdctl.staging.kernels.ranges import copy_ranges, word_bytes

    rng = np.random.default_rng(align)
    source = torch.from_numpy(rng.integers(0, 256, 1 << 18, dtype=np.uint8))
    target = torch.zeros(1 << 18, dtype=torch.uint8)
    count = 40
    lengths = rng.integers(1, 6144 // align, count).astype(np.uint64) * np.uint64(align)
    src_off = rng.integers(0, ((1 << 18) - 6144) // align, count).astype(np.uint64) * np.uint64(
        align
    )
    dst_off = np.arange(count, dtype=np.uint64) * np.uint64(6144)  # disjoint targets
    src = np.uint64(source.data_ptr()) + src_off
    dst = np.uint64(target.data_ptr()) + dst_off
    assert word_bytes(src, dst, lengths) >= align
    copy_ranges(torch.device("cpu"), src, dst, lengths)
    expected = torch.zeros_like(target)
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist(), strict=True):
        expected[d : d + n] = source[s : s + n]
    assert torch.equal(target, expected)


def test_copy_ranges_refuses_a_range_too_long_for_one_launch() -> None:
    from pdctl.staging.kernels import ranges

    one = np.array([0x1000], dtype=np.uint64)
    huge = np.array([ranges.MAX_CHUNKS * ranges.CHUNK_BYTES * 2], dtype=np.uint64)
    with pytest.raises(ValueError, match="too long for one launch"):
        ranges.copy_ranges(torch.device("cpu"), one, one, huge)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_copy_ranges_on_the_device_matches_index_copies() -> None:
    from pdctl.staging.kernels.ranges import copy_ranges

    device = torch.device("cuda", 0)
    rng = np.random.default_rng(11)
    source = torch.from_numpy(rng.integers(0, 256, 64 << 20, dtype=np.uint8)).to(device)
    target = torch.zeros(64 << 20, dtype=torch.uint8, device=device)
    for each, count in ((4096, 1024), (1 << 20, 8), (6, 500)):  # pages, long pieces, odd ones
        target.zero_()
        slots = rng.permutation((64 << 20) // max(each, 4096))[:count].astype(np.uint64)
        stride = np.uint64(max(each, 4096))
        src = np.uint64(source.data_ptr()) + np.arange(count, dtype=np.uint64) * stride
        dst = np.uint64(target.data_ptr()) + slots * stride
        copy_ranges(device, src, dst, np.full(count, each, dtype=np.uint64))
        torch.cuda.synchronize(device)  # cuda-only: GPU test
        for i, slot in enumerate(slots[:64].tolist()):
            s, d = i * int(stride), slot * int(stride)
            assert torch.equal(target[d : d + each], source[s : s + each])


def test_the_transport_knows_how_long_a_range_one_launch_takes() -> None:
    """device_ipc.py keeps the limit without importing Triton; it must be the kernel's."""
    from pdctl.staging.kernels import ranges
    from pdctl.staging.transport import device_ipc

    assert device_ipc.MAX_RANGE_BYTES == ranges.MAX_RANGE_BYTES
