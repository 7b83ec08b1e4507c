"""The Triton kernel backend, for CUDA and XPU (and CPU through TRITON_INTERPRET=1 in CI).

Design:
- One program copies BLOCK_T token rows of one buffer (a layer's K or V); the grid
  is (token blocks, buffers), so one launch covers every layer, K and V.
- Rows are words of the widest integer type the layout allows, and the wrapper
  proves 16-byte alignment where it holds (VEC words), so loads and stores compile
  to 128-bit vector accesses. Copies are bit-exact: no float arithmetic.
- The page lookup and the division by the page size happen once per row, never
  per element; int64 offsets throughout (pools can exceed 2**31 words).
- Buffer addresses come from a device pointer table (int64 bit patterns, so
  addresses with bit 63 set survive). Tables are cached per buffer set, so the
  steady state issues no host-to-device copy besides the page ids, which the
  caller uploads asynchronously from pinned memory.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pdctl.staging.descriptors import pointer_table
from pdctl.staging.kernels.base import BufferCache, KernelBackend

TILE_BYTES = 128 * 1024  # bytes per program (swept on an H200: benchmarks/staging_kernel_sweep.py)
STREAMING = True


@triton.jit
def _copy_rows_kernel(  # type: ignore[no-untyped-def]
    table_ptr,
    pages_ptr,
    staging_ptr,
    num_tokens,
    page_size,
    row_words,
    col_start,
    NUM_COLS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    VEC: tl.constexpr,
    ALIGNED: tl.constexpr,
    STREAMING: tl.constexpr,
    TO_STAGING: tl.constexpr,
):
    block = tl.program_id(0)
    buf = tl.program_id(1)
    kv = tl.load(table_ptr + buf).to(tl.pointer_type(staging_ptr.dtype.element_ty))
    if ALIGNED:
        kv = tl.multiple_of(kv, 16)  # every buffer base is 16-byte aligned (checked on launch)
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    page = tl.load(pages_ptr + tokens // page_size, mask=token_mask, other=0).to(tl.int64)
    kv_rows = tl.multiple_of((page * page_size + tokens % page_size) * row_words + col_start, VEC)
    staged_rows = tl.multiple_of((buf.to(tl.int64) * num_tokens + tokens) * NUM_COLS, VEC)
    for c in tl.static_range(0, NUM_COLS, BLOCK_C):
        cols = tl.max_contiguous(tl.multiple_of(c + tl.arange(0, BLOCK_C), VEC), BLOCK_C)
        mask = token_mask[:, None] & (cols[None, :] < NUM_COLS)
        kv_at = kv + kv_rows[:, None] + cols[None, :]
        staged_at = staging_ptr + staged_rows[:, None] + cols[None, :]
        source = kv_at if TO_STAGING else staged_at
        target = staged_at if TO_STAGING else kv_at
        if STREAMING:  # each byte is touched once: keep it out of the caches
            values = tl.load(source, mask=mask, eviction_policy="evict_first")
            tl.store(target, values, mask=mask, cache_modifier=".cs")
        else:
            tl.store(target, tl.load(source, mask=mask), mask=mask)


@functools.lru_cache(maxsize=256)
def tile(num_cols: int, word_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) for rows of `num_cols` words."""
    block_c = min(triton.next_power_of_2(num_cols), 2048)
    block_t = max(1, min(1024, TILE_BYTES // (block_c * word_bytes)))
    block_t = 1 << (block_t.bit_length() - 1)
    tile_bytes = block_t * block_c * word_bytes
    return block_t, block_c, 16 if tile_bytes >= 64 * 1024 else 8 if tile_bytes >= 16 * 1024 else 4


@functools.lru_cache(maxsize=1024)
def _vec(row_words: int, col_start: int, num_cols: int, word_bytes: int) -> int:
    """Words per 16-byte vector that every row offset provably honours."""
    vec = max(1, 16 // word_bytes)
    while vec > 1 and (row_words % vec or col_start % vec or num_cols % vec):
        vec //= 2
    return vec


def _table(buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The device pointer table, and whether every base is 16-byte aligned."""
    table = pointer_table(buffers, buffers[0].device)
    return table, all(b.data_ptr() % 16 == 0 for b in buffers)


class TritonKernels(KernelBackend):
    name = "triton"

    def __init__(self) -> None:
        self._tables: BufferCache[tuple[torch.Tensor, bool]] = BufferCache(_table)

    def _launch(
        self,
        staging: torch.Tensor,
        buffers: Sequence[torch.Tensor],
        pages: torch.Tensor,
        page_size: int,
        col_start: int,
        to_staging: bool,
    ) -> None:
        num_buffers, num_tokens, num_cols = staging.shape
        if num_tokens == 0:
            return
        word = staging.element_size()
        row_words = buffers[0].shape[1]
        block_t, block_c, num_warps = tile(num_cols, word)
        grid = (triton.cdiv(num_tokens, block_t), num_buffers)
        table, aligned = self._tables.get(buffers)
        _copy_rows_kernel[grid](
            table,
            pages,
            staging,
            num_tokens,
            page_size,
            row_words,
            col_start,
            NUM_COLS=num_cols,
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            VEC=_vec(row_words, col_start, num_cols, word),
            ALIGNED=aligned,
            STREAMING=STREAMING,
            TO_STAGING=to_staging,
            num_warps=num_warps,
        )

    def gather(
        self,
        buffers: Sequence[torch.Tensor],
        pages: torch.Tensor,
        page_size: int,
        staging: torch.Tensor,
        col_start: int,
    ) -> None:
        self._launch(staging, buffers, pages, page_size, col_start, to_staging=True)

    def scatter(
        self,
        staging: torch.Tensor,
        buffers: Sequence[torch.Tensor],
        pages: torch.Tensor,
        page_size: int,
        col_start: int,
    ) -> None:
        self._launch(staging, buffers, pages, page_size, col_start, to_staging=False)
