"""Digests detect corruption and placement; pointers never lose bit 63."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.staging.descriptors import (
    as_u64,
    page_descriptors,
    pointer_table,
    region_descriptors,
    unsigned_ptr,
    xpu_pointer_type,
)
from pdctl.staging.digest import block_digests, chunk_digests, first_mismatch

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
