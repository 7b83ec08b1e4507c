"""The digest sums in one Triton launch: one read of the bytes, no int64 temporaries.

`digest.chunk_digests` defines the value: per chunk, the sum of its words x_i times
(2 i + 1), modulo 2**64. The torch path materialises the words as int64, the
weights and their products (about eleven bytes of traffic per byte digested, and a
host round trip per eight chunks); here program (c, b) loads block b of chunk c
once, widens each word as torch does (signed for int16/int32, unsigned for bytes),
multiplies and sums in int64 (wrapping, as torch's int64 arithmetic does), and
writes one partial sum; the partials are summed by torch. Integer sums modulo 2**64
do not depend on their order, so the values are bit-identical to the torch path
(tests/staging/test_digest_kernel.py, interpreted on the CPU in CI).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from pdctl.staging import device as dev
from pdctl.staging.kernels.digest_tables import PageRows
from pdctl.staging.kernels.launch import DirectLauncher

BLOCK = 4096  # words per program


@triton.jit(do_not_specialize=["chunk_words", "blocks"])
def _digest_kernel(words_ptr, partial_ptr, chunk_words, blocks, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    chunk = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    index = block * BLOCK + tl.arange(0, BLOCK)
    mask = index < chunk_words
    x = tl.load(words_ptr + chunk * chunk_words + index, mask=mask, other=0)
    weighted = x.to(tl.int64) * (index * 2 + 1)
    tl.store(partial_ptr + chunk * blocks + block, tl.sum(weighted, axis=0))


_DIGESTS = DirectLauncher(_digest_kernel, ("BLOCK",))


def digest_sums(words: torch.Tensor) -> list[int]:
    """[n_chunks, n_words] integer words -> each chunk's weighted sum as an int64 value."""
    num_chunks, chunk_words = words.shape
    blocks = triton.cdiv(chunk_words, BLOCK)
    partial = torch.empty(num_chunks, blocks, dtype=torch.int64, device=words.device)
    device = words.device
    with dev.device_context(device):  # Triton launches on the thread's current device
        _DIGESTS((num_chunks, blocks, 1), (words, partial), (chunk_words, blocks), (BLOCK,), 8)
    sums: list[int] = partial.sum(dim=1).tolist()
    return sums


_ROW_INTS = ["row_words", "col_start", "dst_row_words", "dst_col_start"]  # source's, target's


@triton.jit(do_not_specialize=["num_buffers", "page_size", *_ROW_INTS, "blocks"])
def _page_digest_kernel(  # type: ignore[no-untyped-def]
    table_ptr,
    pages_ptr,
    dst_table_ptr,
    dst_pages_ptr,
    segments_ptr,
    partial_ptr,
    num_buffers,
    page_size,
    row_words,
    col_start,
    dst_row_words,
    dst_col_start,
    blocks,
    NUM_COLS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STORE: tl.constexpr,
    VEC: tl.constexpr,
):
    """Program (s * num_buffers + b, j): token block j of segment s in buffer b, read in
    place from its pages; word i of the chunk the gather would make is token t's column
    c (i = t * NUM_COLS + c), weighted 2 i + 1. With STORE, each word read is also
    stored at the same token's row of the target's page, columns from dst_col_start
    (the write and its digest in one read). VEC: every row, column start, column count
    and buffer base is a multiple of VEC words (16 bytes at VEC 4), so accesses vectorise."""
    slot = tl.program_id(0)
    segment = slot // num_buffers
    buffer = slot % num_buffers
    page_start = tl.load(segments_ptr + 2 * segment)
    num_tokens = tl.load(segments_ptr + 2 * segment + 1)
    tokens = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    page = tl.load(pages_ptr + page_start + tokens // page_size, mask=token_mask, other=0)
    rows = (page.to(tl.int64) * page_size + tokens % page_size) * row_words + col_start
    rows = tl.multiple_of(rows, VEC)
    base = tl.multiple_of(tl.load(table_ptr + buffer).to(tl.pointer_type(tl.int32)), 4 * VEC)
    if STORE:
        dst_page = tl.load(dst_pages_ptr + page_start + tokens // page_size, mask=token_mask)
        dst_rows = (dst_page.to(tl.int64) * page_size + tokens % page_size) * dst_row_words
        dst_rows = tl.multiple_of(dst_rows + dst_col_start, VEC)
        dst_base = tl.load(dst_table_ptr + buffer).to(tl.pointer_type(tl.int32))
        dst_base = tl.multiple_of(dst_base, 4 * VEC)
    total = tl.zeros([BLOCK_T], dtype=tl.int64)
    for c in tl.static_range(0, NUM_COLS, BLOCK_C):
        cols = tl.max_contiguous(tl.multiple_of(c + tl.arange(0, BLOCK_C), VEC), BLOCK_C)
        mask = token_mask[:, None] & (cols < NUM_COLS)[None, :]
        x = tl.load(base + rows[:, None] + cols[None, :], mask=mask, other=0)
        if STORE:
            tl.store(dst_base + dst_rows[:, None] + cols[None, :], x, mask=mask)
        index = tokens[:, None] * NUM_COLS + cols[None, :]
        total += tl.sum(x.to(tl.int64) * (index * 2 + 1), axis=1)
    tl.store(partial_ptr + slot * blocks + tl.program_id(1), tl.sum(total, axis=0))


_PAGE_DIGESTS = DirectLauncher(
    _page_digest_kernel, ("NUM_COLS", "BLOCK_T", "BLOCK_C", "STORE", "VEC")
)


def launch_page_digest_sums(
    source: PageRows,
    segments: list[tuple[int, int]],
    page_size: int,
    num_cols: int,
    *,
    target: PageRows | None = None,
    described: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per segment (page_start, num_pages), each buffer's weighted sum over the int32
    words of columns [col_start, +num_cols) of the segment's token rows (pages of
    `page_size` tokens), as a [segments * buffers] int64 tensor on the device, enqueued
    on the current stream.
    With a target, the same words are stored into the target's rows (its pages pair
    with the source's one for one) by the same launch.

    The segment table and page ids go up in one copy; nothing here waits for the device.
    `described`: the segment table already on the device ([segments * 2] int64, each
    segment's first token and its tokens), with page ids already there too (so that
    nothing is uploaded: what a CUDA graph of the launch needs).
    """
    device = source.table.device
    block_c = min(1 << (num_cols - 1).bit_length(), 1024)  # (plain integers: no Triton call)
    block_t = max(1, min(4096 // block_c, 256))
    longest = max(num_pages for _, num_pages in segments) * page_size
    blocks = -(-longest // block_t)
    target_pages = None if target is None else target.pages
    if described is None:
        tables = [segment_table(segments, page_size), source.pages, target_pages]
        described, pages, dst_pages = _upload(device, tables)
    else:
        pages, dst_pages = source.pages, target_pages
    num_buffers = source.num_buffers
    slots = len(segments) * num_buffers
    partial = torch.empty(slots, blocks, dtype=torch.int64, device=device)  # every one written
    if target is None:
        dst_table, dst_pages, dst_row_words, dst_col_start = source.table, pages, 0, 0
    else:
        dst_table, dst_row_words, dst_col_start = target.table, target.row_words, target.col_start
    pointers = (source.table, pages, dst_table, dst_pages, described, partial)
    rows = (source.row_words, source.col_start, dst_row_words, dst_col_start)  # as _ROW_INTS
    ints = (num_buffers, page_size, *rows, blocks)
    vec = min(source.vec(), 4 if target is None else target.vec())
    vec = vec if num_cols % vec == 0 else 1
    constexprs = (num_cols, block_t, block_c, target is not None, vec)
    with dev.device_context(device):  # Triton launches on the thread's current device
        _PAGE_DIGESTS((slots, blocks, 1), pointers, ints, constexprs, 8)
    return partial.sum(dim=1)


def segment_table(segments: Sequence[tuple[int, int]], page_size: int) -> np.ndarray:
    """Each segment (page_start, num_pages) as (its first token, its tokens), flat int64."""
    flat = np.array(segments, dtype=np.int64).reshape(-1, 2)
    flat[:, 1] *= page_size
    return flat.reshape(-1)


def _upload(device: torch.device, parts: list[np.ndarray | torch.Tensor | None]) -> list[Any]:
    """Integer arrays as int64 tensors on `device`: the host ones in one copy, those
    already on the device as they are (None stays None)."""
    out: list[Any] = []
    host: list[tuple[int, np.ndarray]] = []  # (index in parts, the ids)
    for index, part in enumerate(parts):
        if part is None or (isinstance(part, torch.Tensor) and part.device == device):
            out.append(None if part is None else part.to(torch.int64))
        else:
            out.append(None)
            host.append((index, np.asarray(part, dtype=np.int64)))
    if not host:
        return out
    # Each part starts 16-byte aligned (an even number of int64s), as Triton assumes of
    # the pointers it compiled for: a part at another alignment would compile again.
    sizes = [len(ids) + len(ids) % 2 for _, ids in host]
    joined = np.empty(sum(sizes), dtype=np.int64)
    offset = 0
    for (_, ids), size in zip(host, sizes, strict=True):
        joined[offset : offset + len(ids)] = ids
        offset += size
    uploaded = torch.from_numpy(joined)
    if device.type != "cpu":
        uploaded = uploaded.to(device, non_blocking=True)
    offset = 0
    for (index, ids), size in zip(host, sizes, strict=True):
        out[index] = uploaded[offset : offset + len(ids)]
        offset += size
    return out
