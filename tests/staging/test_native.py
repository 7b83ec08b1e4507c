"""The CPU staging copy in C (`kernels.native`): built here (CI has a C compiler), used
by the torch backend on the CPU, declining what it does not copy, checking page ids
before the C code trusts them, and saying why when it cannot be built."""

from __future__ import annotations

import pytest
import torch

from pdctl.staging.kernels import native
from pdctl.staging.kernels.base import KVColumns
from pdctl.staging.kernels.reference import TorchKernels
from tests.staging.kv_factory import as_bits, random_kv


def words(num_layers: int = 2, pool: int = 32, heads: int = 4, dim: int = 16):  # type: ignore[no-untyped-def]
    k, v = random_kv(num_layers, pool, heads, dim, torch.bfloat16, seed=3)
    return [
        as_bits(b).view(torch.int64).view(pool, -1) for pair in zip(k, v, strict=True) for b in pair
    ]


def test_the_c_copy_is_built_and_serves_the_cpu() -> None:
    ok, why = native.available()
    assert ok, why
    buffers = words()
    pages = torch.tensor([5, 0, 9], dtype=torch.int64)
    staging = torch.empty(len(buffers), 3 * 2, 4, dtype=torch.int64)  # page 2, 4 of 16 words
    assert native.copy_rows(KVColumns(buffers, pages, 2, 8), staging, to_staging=True)
    rows = [p * 2 + t for p in pages.tolist() for t in range(2)]
    for b, buffer in enumerate(buffers):
        assert torch.equal(staging[b], buffer[rows, 8:12])
    targets = [torch.zeros_like(b) for b in buffers]
    assert native.copy_rows(KVColumns(targets, pages, 2, 8), staging, to_staging=False)
    for target, buffer in zip(targets, buffers, strict=True):
        assert torch.equal(target[rows, 8:12], buffer[rows, 8:12])
        untouched = torch.ones(target.shape[0], dtype=torch.bool)
        untouched[rows] = False
        assert not target[untouched].any() and not target[rows, :8].any()


def test_layouts_it_does_not_copy_are_declined_untouched() -> None:
    buffers = words()
    staging = torch.zeros(len(buffers), 2, 4, dtype=torch.int64)
    pages = torch.tensor([1, 2], dtype=torch.int64)
    strided = [b[:, ::2] for b in buffers]  # rows not contiguous
    assert not native.copy_rows(KVColumns(strided, pages, 1, 0), staging, to_staging=True)
    assert not native.copy_rows(KVColumns(buffers, pages.int(), 1, 0), staging, to_staging=True)
    kv = KVColumns(buffers, pages, 1, 0)
    assert not native.copy_rows(kv, staging.transpose(1, 2), to_staging=True)
    assert not staging.any()


@pytest.mark.parametrize("bad", [[32], [-1], [0, 16]])
def test_page_ids_outside_the_pool_are_refused_before_any_copy(bad) -> None:
    buffers = words(pool=32)
    staging = torch.zeros(len(buffers), 2 * len(bad), 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="outside the pool"):
        TorchKernels().gather(KVColumns(buffers, torch.tensor(bad), 2, 0), staging)
    assert not staging.any()


def test_a_failed_build_says_why(monkeypatch, tmp_path) -> None:
    directory = tmp_path / "native"
    monkeypatch.setenv("CC", "false")
    with pytest.raises(OSError, match=r"building native_rows\.c failed"):
        native.build(directory=directory)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError):
        native.build(directory=directory)


@pytest.mark.parametrize(
    ("page_size", "chunk_words", "col_words", "threads"),
    [
        (1, 128, 128, 2),  # 256-byte chunks at 256-byte offsets: streamed
        (64, 512, 0, 3),  # whole pages of 1 KiB chunks, threads splitting mid-buffer
        (3, 5, 1, 2),  # 10-byte chunks at 2-byte offsets: copied without streaming
        (16, 32, 16, 1),  # 64-byte chunks at 32-byte offsets, one thread: streamed
        (2, 32, 4, 2),  # 64-byte chunks at 8-byte offsets: not aligned, not streamed
    ],
)
def test_a_large_copy_lands_every_byte_whatever_the_path(
    page_size: int, chunk_words: int, col_words: int, threads: int
) -> None:
    """Copies of 4 MiB and more stream their stores where chunk and address allow, and
    the walk steps (buffer, page, slot) without dividing: every byte lands where
    index_select says, in both directions, on threads that split buffers anywhere."""
    num_buffers, pages_used = 6, 12288 // page_size + 7  # 4.5 MiB and more of int16 words
    row_words = 2 * chunk_words + col_words
    generator = torch.Generator().manual_seed(page_size)
    pool_pages = pages_used + 11
    shape = (pool_pages * page_size, row_words)
    buffers = [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
        for _ in range(num_buffers)
    ]
    pages = torch.randperm(pool_pages, generator=generator)[:pages_used]
    tokens = pages_used * page_size
    rows = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    staging = torch.empty(num_buffers, tokens, chunk_words, dtype=torch.int16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = KVColumns(buffers, pages, page_size, col_words)
        assert native.copy_rows(source, staging, to_staging=True)
        for b, buffer in enumerate(buffers):
            assert torch.equal(staging[b], buffer[rows, col_words : col_words + chunk_words]), b
        targets = [torch.zeros_like(b) for b in buffers]
        target_rows = KVColumns(targets, pages, page_size, col_words)
        assert native.copy_rows(target_rows, staging, to_staging=False)
    finally:
        torch.set_num_threads(before)
    for target, buffer in zip(targets, buffers, strict=True):
        window = slice(col_words, col_words + chunk_words)
        assert torch.equal(target[rows, window], buffer[rows, window])
        untouched = torch.ones(target.shape[0], dtype=torch.bool)
        untouched[rows] = False
        assert not target[untouched].any() and not target[:, :col_words].any()
        assert not target[:, col_words + chunk_words :].any()
