"""Transfer descriptors and device pointers as unsigned 64-bit values.

Device pointers can set bit 63 (XPU kernel-space addresses), which a signed int64
reads as negative and `torch.tensor(..., dtype=torch.int64)` rejects. Every
descriptor here is a `np.uint64` array, and pointer tables for kernels are built
through a uint64 -> int64 bit cast, never through a signed conversion.

The address arithmetic of a transfer lives here too: where a region of a ring is,
where a writer's block goes in it (`layout`), and the writes of a direct transfer
(pages, or token rows of a head slice, straight into a peer's KV buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdctl.staging.layout import HeadSlice, StagingLayout

U64_MASK = (1 << 64) - 1


def unsigned_ptr(pointer: int) -> int:
    """A pointer as an unsigned 64-bit Python int, whatever sign it came with."""
    return pointer & U64_MASK


def tensor_ptr(tensor: torch.Tensor) -> int:
    return unsigned_ptr(tensor.data_ptr())


def as_u64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Python ints (any sign, < 2**64) -> np.uint64 without truncation."""
    if isinstance(values, np.ndarray):
        if values.dtype == np.uint64:
            return values
        if values.dtype.kind == "i":
            return values.astype(np.int64).view(np.uint64)
        raise TypeError(f"pointers must be integers, got dtype {values.dtype}")
    return np.array([unsigned_ptr(int(v)) for v in values], dtype=np.uint64)


def pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Kernel pointer table: data pointers as int64 bit patterns, on `device`."""
    bits = as_u64([tensor_ptr(t) for t in tensors]).view(np.int64)
    return torch.from_numpy(bits.copy()).to(device)


def region_descriptors(
    src_base: int, dst_base: int, offsets: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_ptrs, dst_ptrs, lengths) for writes of [offset, offset+length) of two buffers."""
    offsets = as_u64(offsets)
    lengths = as_u64(lengths)
    src = np.uint64(unsigned_ptr(src_base)) + offsets
    dst = np.uint64(unsigned_ptr(dst_base)) + offsets
    return src, dst, lengths


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, ...]:
    """Maximal runs of pages consecutive on both sides: (src first, dst first, length).

    A scheduler hands out pages lowest first, so a request's pages are mostly runs;
    one descriptor per run instead of per page (SGLang's KV senders group the same
    way). Pages 3 4 5 9 -> 7 8 9 0 give the runs (3, 7, 3) and (9, 0, 1).
    """
    src_pages = np.asarray(src_pages, dtype=np.int64)
    dst_pages = np.asarray(dst_pages, dtype=np.int64)
    joined = (np.diff(src_pages) == 1) & (np.diff(dst_pages) == 1)  # page i+1 extends i
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    lengths = np.diff(np.append(starts, len(src_pages)))
    return src_pages[starts], dst_pages[starts], lengths


def page_descriptors(
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    page_bytes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Direct (no staging) page copies: for every buffer pair, one descriptor per run of
    pages consecutive on both sides (`page_runs`), buffer-major.

    `src_bases[i]` and `dst_bases[i]` are the base addresses of matching KV buffers
    (layer K, layer V, ...) whose pages are `page_bytes` apart.
    """
    if len(src_bases) != len(dst_bases) or len(src_pages) != len(dst_pages):
        raise ValueError("buffer and page lists must pair up")
    if len(src_pages) == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    src_first, dst_first, run_pages = page_runs(src_pages, dst_pages)
    size = np.uint64(page_bytes)
    src_off = as_u64(src_first) * size
    dst_off = as_u64(dst_first) * size
    src = (as_u64(src_bases)[:, None] + src_off[None, :]).reshape(-1)
    dst = (as_u64(dst_bases)[:, None] + dst_off[None, :]).reshape(-1)
    lengths = np.tile(as_u64(run_pages) * size, len(src_bases))
    return src, dst, lengths


def offset_address(base: int, offset: int) -> int:
    """`base + offset` as an unsigned 64-bit address (a byte of a registered buffer)."""
    return unsigned_ptr(unsigned_ptr(base) + offset)


def block_address(region_address: int, layout: StagingLayout, writer: int, num_tokens: int) -> int:
    """Where writer `writer`'s block of a `num_tokens` segment goes in a ring region."""
    return offset_address(region_address, layout.block_offset(writer, num_tokens))


def kv_bases(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]) -> list[int]:
    """Base addresses of per-layer KV buffers in transfer order: [L0.K, L0.V, L1.K, ...]."""
    return [tensor_ptr(b) for pair in zip(k_buffers, v_buffers, strict=True) for b in pair]


@dataclass(frozen=True)
class KVRows:
    """How a direct transfer's token rows look on both sides: a buffer is
    [pool_tokens, heads, head_bytes], token row t = page * page_size + i, and `piece`
    names the heads that move."""

    page_size: int
    head_bytes: int
    src_heads: int
    dst_heads: int
    piece: HeadSlice


def head_slice_descriptors(
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    src_pages: Sequence[int] | np.ndarray,
    dst_pages: Sequence[int] | np.ndarray,
    rows: KVRows,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One write per buffer and token row: the slice's heads of every row of `src_pages`
    into the matching row of `dst_pages` (buffer-major, rows in page order).

        src row t:  | h0 | .. | h(src_head_start) .. +num_heads | .. |   src_heads heads
        dst row t': | h0 | .. | h(dst_head_start) .. +num_heads | .. |   dst_heads heads
        src = src_base + t * src_heads * head_bytes + src_head_start * head_bytes
    """
    if len(src_bases) != len(dst_bases) or len(src_pages) != len(dst_pages):
        raise ValueError("buffer and page lists must pair up")
    piece, head_bytes = rows.piece, rows.head_bytes

    def row_ids(pages: Sequence[int] | np.ndarray) -> np.ndarray:  # [num_pages * page_size]
        first = as_u64(np.asarray(pages, dtype=np.int64)) * np.uint64(rows.page_size)
        return (first[:, None] + np.arange(rows.page_size, dtype=np.uint64)[None, :]).reshape(-1)

    src_start = as_u64(src_bases) + np.uint64(piece.src_head_start * head_bytes)
    dst_start = as_u64(dst_bases) + np.uint64(piece.dst_head_start * head_bytes)
    src_offsets = row_ids(src_pages) * np.uint64(rows.src_heads * head_bytes)
    dst_offsets = row_ids(dst_pages) * np.uint64(rows.dst_heads * head_bytes)
    src = (src_start[:, None] + src_offsets[None, :]).reshape(-1)
    dst = (dst_start[:, None] + dst_offsets[None, :]).reshape(-1)
    return src, dst, np.full(src.shape, piece.num_heads * head_bytes, dtype=np.uint64)


def direct_descriptors(
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    src_pages: Sequence[int] | np.ndarray,
    dst_pages: Sequence[int] | np.ndarray,
    rows: KVRows,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A direct (unstaged) transfer of one head slice into a peer's KV pages: runs of
    whole pages when both sides hold exactly the slice's heads, else one write per
    token row."""
    heads = rows.piece.num_heads
    if rows.src_heads == heads and rows.dst_heads == heads:
        page_bytes = rows.page_size * heads * rows.head_bytes
        return page_descriptors(
            src_bases, dst_bases, np.asarray(src_pages), np.asarray(dst_pages), page_bytes
        )
    return head_slice_descriptors(src_bases, dst_bases, src_pages, dst_pages, rows)


def xpu_pointer_type(pointer: int) -> str:
    """XPU registrations name the address space: bit 63 set means kernel space."""
    return "XPU-kernel-space" if unsigned_ptr(pointer) >> 63 else "XPU-user-space"
