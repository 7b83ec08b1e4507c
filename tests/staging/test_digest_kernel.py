"""The Triton digest sums (interpreted on the CPU) equal the torch path bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdctl.staging.digest import (
    block_digests,
    chunk_digests,
    digest_of_sum,
    digests_of_sums,
)

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(
    ("nbytes", "chunks"),
    [(4 * 9000 * 6, 6), (2 * 4097 * 2, 2), (3 * 5, 5), (4 * 4096 * 2, 2), (4 << 20, 1)],
)  # int32 words over blocks, int16 words, bytes, whole blocks, sums past 2**64
def test_triton_digests_equal_the_torch_path(nbytes: int, chunks: int) -> None:
    generator = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    data[:8] = 0xFF  # negative words: sign extension must agree
    expected = chunk_digests(data, chunks, backend="torch")
    assert chunk_digests(data, chunks, backend="triton") == expected
    changed = data.clone()
    changed[nbytes // 2] ^= 1
    assert chunk_digests(changed, chunks, backend="triton") != expected


def test_an_unknown_digest_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown digest backend 'cuda'"):
        block_digests(torch.zeros(16, dtype=torch.uint8), 1, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_device_digests_equal_the_host_ones() -> None:
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=generator)
    on_host = block_digests(data, 16, backend="torch")
    assert block_digests(data.cuda(), 16) == on_host  # the device default: triton
    assert block_digests(data.cuda(), 16, backend="torch") == on_host


def test_sums_past_two_to_the_64_wrap_alike() -> None:
    data = torch.full((4 << 20,), 0x7F, dtype=torch.uint8)  # every word 0x7F7F7F7F
    words, weights = data.view(torch.int32).double(), torch.arange(1 << 20).double() * 2 + 1
    assert float((words * weights).sum()) > 2.0**64  # the sum really wraps
    assert chunk_digests(data, 1, backend="triton") == chunk_digests(data, 1, backend="torch")


@pytest.mark.parametrize(
    ("dtype", "page_size", "split", "segments"),
    [
        (torch.bfloat16, 1, (8, 4, 4), [(0, 6)]),
        (torch.bfloat16, 4, (8, 0, 8), [(0, 2), (2, 3), (5, 1)]),
        (torch.float32, 16, (4, 1, 2), [(0, 1), (1, 5)]),
        (torch.float16, 2, (2, 1, 1), [(3, 3), (0, 3)]),
    ],
)
def test_page_digests_in_place_equal_gather_then_digest(dtype, page_size, split, segments) -> None:
    """The paged kernel (interpreted) reads the pages in place; the values must be
    those of gathering each segment's head slice and digesting the block."""
    from pdctl.staging.kernels import KVSlice, gather_slice, slice_digests
    from tests.staging.kv_factory import as_bits, random_kv, random_pages

    heads, start, count = split
    layers, pool_pages, head_dim = 3, 10, 16
    k, v = random_kv(layers, pool_pages * page_size, heads, head_dim, dtype, 7, "cpu")
    pages = random_pages(pool_pages, 6, 7)
    heads = KVSlice(start, count, page_size)
    expected = []
    for first, num in segments:
        nbytes = 2 * layers * num * page_size * count * head_dim * k[0].element_size()
        block = torch.empty(nbytes, dtype=torch.uint8)
        gather_slice(k, v, pages[first : first + num], block, heads, "torch")
        expected.append(block_digests(block, layers, backend="torch"))
    for backend in ("triton", "torch"):
        got = slice_digests(k, v, pages, segments, heads, backend)
        assert got == expected, backend
    as_bits(k[1])[int(pages[segments[0][0]]) * page_size, start, 3] ^= 1  # a bit of layer 1's K
    changed = slice_digests(k, v, pages, segments, heads, "triton")
    assert changed[0][2] != expected[0][2] and changed[0][:2] == expected[0][:2]


def test_page_digests_refuse_a_segment_outside_the_page_list() -> None:
    from pdctl.staging.kernels import KVSlice, slice_digests
    from tests.staging.kv_factory import random_kv

    k, v = random_kv(1, 8, 2, 16, torch.float32, 1, "cpu")
    with pytest.raises(ValueError, match=r"segment of pages \[2, 5\) is outside the 4 pages"):
        slice_digests(k, v, [0, 1, 2, 3], [(2, 3)], KVSlice(0, 2, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_page_digests_on_the_device_equal_the_host_ones() -> None:
    from pdctl.staging.kernels import KVSlice, slice_digests
    from tests.staging.kv_factory import random_kv, random_pages

    k, v = random_kv(16, 64 * 16, 8, 128, torch.bfloat16, 5, "cpu")
    pages = random_pages(64, 40, 5)
    segments, heads = [(0, 16), (16, 16), (32, 8)], KVSlice(4, 4, 16)
    host = slice_digests(k, v, pages, segments, heads)
    kc, vc = [t.cuda() for t in k], [t.cuda() for t in v]
    on_device = slice_digests(kc, vc, pages, segments, heads)
    assert on_device == host  # the device default: one Triton launch, pages read in place


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40), st.data())
def test_the_mix_over_arrays_is_the_scalar_mix(sums, data) -> None:
    words = data.draw(st.lists(st.integers(1, 2**40), min_size=len(sums), max_size=len(sums)))
    got = digests_of_sums(np.asarray(sums, dtype=np.int64), np.asarray(words, dtype=np.uint64))
    assert got == [digest_of_sum(s, w) for s, w in zip(sums, words, strict=True)]
