"""The Triton kernel backend, for CUDA and XPU (and CPU through TRITON_INTERPRET=1 in CI).

Design:
- One launch covers every layer, K and V. A program owns BLOCK_T token rows and
  walks `num_steps` groups of BLOCK_B buffers; each step copies a
  [BLOCK_B, BLOCK_T, BLOCK_C] tile. The page lookup (one load and one division per
  token row) happens once per program and serves every buffer it walks; there is
  no per-element division.
- Rows are words of the widest integer type the layout allows, and the wrapper
  proves 16-byte alignment where it holds (VEC words), so loads and stores compile
  to 128-bit vector accesses. Copies are bit-exact: no float arithmetic. Every byte
  is touched once, so loads are evict-first and stores streaming.
- `tile()` picks the shape: up to TILE_BYTES of token rows per step. With
  PROGRAMS_PER_SM = 0 every program copies one tile of one buffer (grid: token
  blocks x buffers), the configuration measured best on an H200: 16 KiB tiles, 8
  warps, 0.95-0.99 of a device copy (gather) and 0.95 (scatter) on all four bench
  shapes as the device sees it (graph replay), against 0.84-0.89 / 0.91-0.93 with
  the 128 KiB tiles before (benchmarks/staging_kernel_sweep.py, docs/benchmarks.md).
  With PROGRAMS_PER_SM = n, buffers fold into walks that leave about n programs per
  multiprocessor, so index work and program start-up are paid once per
  walk: the candidate for the page-1 shapes, which benchmarks/staging_kernel_sweep.py
  times device-only (graph replay) against the default before it becomes one.
- int64 offsets throughout (pools can exceed 2**31 words). Buffer addresses come
  from a device pointer table (int64 bit patterns, so addresses with bit 63 set
  survive), cached per buffer set: the steady state uploads nothing but the page
  ids, which the caller uploads asynchronously from pinned memory (the sweep also
  times the kernel reading pinned page ids in place, without the upload).
- Host cost matters as much as the kernel for small transfers (a 112 MiB transfer
  takes about 60 us on an H200, a checked call about 70 us of host work): tile
  choices are cached per shape, and after the first call of a configuration the
  compiled kernel is launched directly (`launch.DirectLauncher`), skipping Triton's per-call
  argument binding. Launches happen on the tensors' device whatever the calling
  thread's current device (transfer threads start on device 0).

Tile, one step (BLOCK_B buffers x BLOCK_T tokens x BLOCK_C words):

    KV buffer b:   row(t) * row_words + col_start + [0, NUM_COLS)
    staging:       (b * num_tokens + t) * NUM_COLS + [0, NUM_COLS)
    row(t) = pages[t // page_size] * page_size + t % page_size
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pdctl.staging import device as dev
from pdctl.staging.descriptors import pointer_table
from pdctl.staging.kernels.base import BufferCache, KernelBackend, KVColumns
from pdctl.staging.kernels.launch import DirectLauncher, current_device

# The best configuration measured on an H200 (16 KiB tiles, 8 warps, no walks);
# benchmarks/staging_kernel_sweep.py times the others against it.
TILE_BYTES = 16 * 1024  # bytes per program step
PROGRAMS_PER_SM = 0  # 0: one tile of one buffer per program; n: walks, >= n programs per SM
STREAMING = True
WARPS = 0  # 0: by tile size (16 from 64 KiB, 8 from 16 KiB, else 4); n: always n
DEFAULT_SMS = 132


CONSTEXPRS = (
    "NUM_COLS",
    "BLOCK_T",
    "BLOCK_C",
    "BLOCK_B",
    "VEC",
    "ALIGNED",
    "STREAMING",
    "TO_STAGING",
)
_INTS = ["num_tokens", "num_buffers", "num_steps", "page_size", "row_words", "col_start"]


@triton.jit(do_not_specialize=_INTS)
def _copy_rows_kernel(  # type: ignore[no-untyped-def]
    table_ptr,
    pages_ptr,
    staging_ptr,
    num_tokens,
    num_buffers,
    num_steps,
    page_size,
    row_words,
    col_start,
    NUM_COLS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
    VEC: tl.constexpr,
    ALIGNED: tl.constexpr,
    STREAMING: tl.constexpr,
    TO_STAGING: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    page = tl.load(pages_ptr + tokens // page_size, mask=token_mask, other=0).to(tl.int64)
    kv_rows = tl.multiple_of((page * page_size + tokens % page_size) * row_words + col_start, VEC)
    tokens64 = tokens.to(tl.int64)
    first = tl.program_id(1) * num_steps * BLOCK_B
    for step in range(num_steps):
        buffers = first + step * BLOCK_B + tl.arange(0, BLOCK_B)
        buffer_mask = buffers < num_buffers
        kv = tl.load(table_ptr + buffers, mask=buffer_mask, other=0)
        kv = kv.to(tl.pointer_type(staging_ptr.dtype.element_ty))
        if ALIGNED:
            kv = tl.multiple_of(kv, 16)  # every buffer base is 16-byte aligned (checked)
        # a multiple of VEC words: NUM_COLS is (the wrapper picks VEC so)
        staged_rows = (buffers.to(tl.int64)[:, None] * num_tokens + tokens64[None, :]) * NUM_COLS
        rows_mask = buffer_mask[:, None] & token_mask[None, :]
        for c in tl.static_range(0, NUM_COLS, BLOCK_C):
            cols = tl.max_contiguous(tl.multiple_of(c + tl.arange(0, BLOCK_C), VEC), BLOCK_C)
            mask = rows_mask[:, :, None] & (cols < NUM_COLS)[None, None, :]
            kv_at = kv[:, None, None] + kv_rows[None, :, None] + cols[None, None, :]
            staged_at = staging_ptr + staged_rows[:, :, None] + cols[None, None, :]
            source = kv_at if TO_STAGING else staged_at
            target = staged_at if TO_STAGING else kv_at
            if STREAMING:
                values = tl.load(source, mask=mask, eviction_policy="evict_first")
                tl.store(target, values, mask=mask, cache_modifier=".cs")
            else:
                tl.store(target, tl.load(source, mask=mask), mask=mask)


@functools.lru_cache(maxsize=4096)
def tile(
    num_cols: int, word_bytes: int, num_tokens: int, num_buffers: int, num_sms: int
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_T, BLOCK_C, BLOCK_B, num_steps, programs along buffers, num_warps).

    A step's tile is up to TILE_BYTES of token rows. With PROGRAMS_PER_SM = n, the
    buffers fold into walks that leave about n programs per multiprocessor (a step
    takes several buffers only where the programs would still be that many); with
    0, every program copies one tile of one buffer.
    """
    block_c = min(triton.next_power_of_2(num_cols), 2048)
    row_bytes = block_c * word_bytes
    block_t = max(1, min(TILE_BYTES // row_bytes, triton.next_power_of_2(num_tokens), 1024))
    block_t = 1 << (block_t.bit_length() - 1)
    token_blocks = triton.cdiv(num_tokens, block_t)
    wanted = num_sms * PROGRAMS_PER_SM
    block_b = 1
    while (
        wanted
        and block_b * 2 * block_t * row_bytes <= TILE_BYTES
        and token_blocks * triton.cdiv(num_buffers, block_b * 2) >= wanted
    ):
        block_b *= 2
    buffer_steps = triton.cdiv(num_buffers, block_b)
    buffer_programs = max(1, min(buffer_steps, wanted // token_blocks)) if wanted else buffer_steps
    num_steps = triton.cdiv(buffer_steps, buffer_programs)
    buffer_programs = triton.cdiv(buffer_steps, num_steps)  # even walks, none empty
    tile_bytes = block_b * block_t * row_bytes
    num_warps = 16 if tile_bytes >= 64 * 1024 else 8 if tile_bytes >= 16 * 1024 else 4
    if WARPS:
        num_warps = WARPS
    return block_t, block_c, block_b, num_steps, buffer_programs, num_warps


@functools.lru_cache(maxsize=1024)
def _vec(row_words: int, col_start: int, num_cols: int, word_bytes: int) -> int:
    """Words per 16-byte vector that every row offset provably honours."""
    vec = max(1, 16 // word_bytes)
    while vec > 1 and (row_words % vec or col_start % vec or num_cols % vec):
        vec //= 2
    return vec


@functools.lru_cache(maxsize=64)
def _num_sms(device: torch.device) -> int:
    if device.type == "cpu":
        return DEFAULT_SMS
    properties = dev.get_device_module(device).get_device_properties(device)
    return int(getattr(properties, "multi_processor_count", 0) or DEFAULT_SMS)


def _table(buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool, int]:
    """The device pointer table, whether every base is 16-byte aligned, and the SM count."""
    table = pointer_table(buffers, buffers[0].device)
    aligned = all(b.data_ptr() % 16 == 0 for b in buffers)
    return table, aligned, _num_sms(buffers[0].device)


class TritonKernels(KernelBackend):
    name = "triton"

    def __init__(self) -> None:
        self._tables: BufferCache[tuple[torch.Tensor, bool, int]] = BufferCache(_table)
        self._launch_kernel = DirectLauncher(_copy_rows_kernel, CONSTEXPRS)

    def _launch(self, staging: torch.Tensor, kv: KVColumns, to_staging: bool) -> None:
        num_buffers, num_tokens, num_cols = staging.shape
        if num_tokens == 0:
            return
        word = staging.element_size()
        row_words = kv.buffers[0].shape[1]
        table, aligned, num_sms = self._tables.get(kv.buffers)
        block_t, block_c, block_b, num_steps, buffer_programs, warps = tile(
            num_cols, word, num_tokens, num_buffers, num_sms
        )
        grid = (triton.cdiv(num_tokens, block_t), buffer_programs, 1)
        ints = (num_tokens, num_buffers, num_steps, kv.page_size, row_words, kv.col_start)
        vec = _vec(row_words, kv.col_start, num_cols, word)
        constexprs = (num_cols, block_t, block_c, block_b, vec, aligned, STREAMING, to_staging)
        pointers = (table, kv.pages, staging)
        device = staging.device
        if device.type == "cpu" or device.index == current_device():
            self._launch_kernel(grid, pointers, ints, constexprs, warps)
            return
        with dev.device_context(device):  # Triton launches on the thread's current device
            self._launch_kernel(grid, pointers, ints, constexprs, warps)

    def gather(self, kv: KVColumns, staging: torch.Tensor) -> None:
        self._launch(staging, kv, to_staging=True)

    def scatter(self, staging: torch.Tensor, kv: KVColumns) -> None:
        self._launch(staging, kv, to_staging=False)
