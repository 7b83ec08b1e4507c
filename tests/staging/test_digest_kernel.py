"""The Triton digest sums (interpreted on the CPU) equal the torch path bit for bit."""

from __future__ import annotations

import pytest
import torch

from pdctl.staging.digest import block_digests, chunk_digests

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
