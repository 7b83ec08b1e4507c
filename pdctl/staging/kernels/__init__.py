"""Checked gather/scatter between paged KV buffers and staging, on any device.

`gather_slice` copies one slice of every layer (K and V: a `KVSlice`, its heads in
pages of `page_size` tokens) for a list of pages into a contiguous staging block;
`scatter_slice` copies a block back into KV pages, `scatter_staging_to_kv` also a
region with several writers' blocks. The device comes from the KV buffers; staging
on another device is an error. Arguments are validated here, then a backend
(`triton` on CUDA and XPU, `torch` elsewhere) does the copy on integer views, so
results are bit-identical across backends. `slice_digests` digests a slice where it
lies in the pages. `gather_all_layers_to_staging` takes the slice as keywords (the
upstream seed's public form, kept as it was).

Shapes:
    k_buffers[l], v_buffers[l]   [pool_tokens, num_kv_heads, head_dim], one per layer
    page_indices                 [num_pages] page ids (token row = page * page_size + i)
    staging block                L x (K, V) x [num_pages * page_size, num_heads, head_dim]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pdctl.staging.digest import block_digests
from pdctl.staging.kernels import captured
from pdctl.staging.kernels.base import KVColumns, get_backend
from pdctl.staging.kernels.captured import CapturedCalls
from pdctl.staging.kernels.checks import check_heads, check_segments
from pdctl.staging.kernels.digest_tables import page_rows
from pdctl.staging.kernels.dispatch import backend_for
from pdctl.staging.kernels.kvset import WORD_DTYPES, KVInfo, KVSet, describe_kv, prepare_kv
from pdctl.staging.kernels.pages import (
    PageIndices,
    checked_pages,
    host_ids,
    upload_pages,
    usual_ids,
)
from pdctl.staging.kernels.pending import PendingDigests
from pdctl.staging.layout import HeadSlice, KVSlice


def _word_bytes(kvset: KVSet, block: torch.Tensor) -> int:
    """The widest word for this block: the KV set's, narrowed to the block's alignment."""
    offset = int(block.storage_offset()) * block.element_size()
    word = kvset.max_word
    while word > 1 and offset % word:
        word //= 2
    return word


def _flat_bytes(staging: torch.Tensor, info: KVInfo) -> torch.Tensor:
    if staging.device != info.device:
        raise ValueError(f"KV buffers are on {info.device} but staging is on {staging.device}")
    if not staging.is_contiguous():
        raise ValueError("staging must be contiguous")
    if staging.dtype == torch.uint8 and staging.dim() == 1:
        return staging  # the usual case: a byte buffer, no views to make
    return staging.reshape(-1).view(torch.uint8)


def _staging_words(
    flat: torch.Tensor, nbytes: int, word: int, shape: tuple[int, int, int]
) -> torch.Tensor:
    if flat.numel() < nbytes:
        raise ValueError(f"staging holds {flat.numel()} bytes but {nbytes} are needed")
    return flat[:nbytes].view(WORD_DTYPES[word]).view(shape)


def gather_slice(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    staging: torch.Tensor,
    kv_slice: KVSlice,
    backend: str | None = None,
) -> int:
    """Gather the slice's heads of every layer's K and V into `staging`; returns bytes.

    On CUDA a call that comes back the same is replayed from a graph (`captured`)."""
    page_size = kv_slice.page_size

    def eager(pages: PageIndices) -> int:
        return _gather(k_buffers, v_buffers, pages, staging, kv_slice, backend)

    params = ("gather", kv_slice.head_start, kv_slice.num_heads, backend)
    return _replayed(params, k_buffers, v_buffers, staging, page_indices, page_size, eager)


def gather_all_layers_to_staging(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    staging: torch.Tensor,
    *,
    src_head_start: int,
    num_heads: int,
    page_size: int,
    backend: str | None = None,
) -> int:
    """`gather_slice` with the slice given by keywords (the form callers outside staging
    use): heads [src_head_start, +num_heads) in pages of `page_size` tokens."""
    kv_slice = KVSlice(src_head_start, num_heads, page_size)
    return gather_slice(k_buffers, v_buffers, page_indices, staging, kv_slice, backend)


def _gather(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    staging: torch.Tensor,
    kv_slice: KVSlice,
    backend: str | None,
) -> int:
    kvset = prepare_kv(k_buffers, v_buffers)
    info = kvset.info
    check_heads(kv_slice, info, "source")
    name = backend_for(info, backend)
    pages = upload_pages(page_indices, kv_slice.page_size, info)
    num_tokens = pages.numel() * kv_slice.page_size
    flat = _flat_bytes(staging, info)
    word = _word_bytes(kvset, flat)
    col_start, num_cols = info.columns(kv_slice, word)
    shape = (2 * info.num_layers, num_tokens, num_cols)
    nbytes = shape[0] * shape[1] * shape[2] * word
    out = _staging_words(flat, nbytes, word, shape)
    rows = KVColumns(kvset.views(word), pages, kv_slice.page_size, col_start)
    get_backend(name).gather(rows, out)
    return nbytes


def scatter_slice(
    staging: torch.Tensor,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    kv_slice: KVSlice,
    backend: str | None = None,
) -> int:
    """Scatter one block of `staging` into the slice's heads of every layer's K and V;
    returns the bytes consumed. On CUDA a call that comes back the same is replayed
    from a graph (`captured`)."""
    page_size = kv_slice.page_size

    def eager(pages: PageIndices) -> int:
        block = HeadSlice(0, 0, kv_slice.head_start, kv_slice.num_heads)  # made here: a
        # replay needs none, and each object costs a microsecond of a slow host's replay
        return _scatter(staging, k_buffers, v_buffers, pages, page_size, (block,), backend)

    params = ("scatter", kv_slice.head_start, kv_slice.num_heads, backend)  # ints hash at C speed
    return _replayed(params, k_buffers, v_buffers, staging, page_indices, page_size, eager)


def scatter_staging_to_kv(
    staging: torch.Tensor,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    *,
    page_size: int,
    dst_head_start: int | None = None,
    num_heads: int | None = None,
    writers: Sequence[HeadSlice] | None = None,
    backend: str | None = None,
) -> int:
    """Scatter one block (dst_head_start, num_heads: `scatter_slice`) or a region of
    several writers' blocks.

    With `writers`, the region holds one block per writer in order (see `layout`),
    each scattered into its own destination heads. Returns the bytes consumed. On
    CUDA a call that comes back the same is replayed from a graph (`captured`).
    """
    if writers is None:
        if dst_head_start is None or num_heads is None:
            raise ValueError("give dst_head_start and num_heads, or writers")
        kv_slice = KVSlice(dst_head_start, num_heads, page_size)
        return scatter_slice(staging, k_buffers, v_buffers, page_indices, kv_slice, backend)
    if dst_head_start is not None or num_heads is not None:
        raise ValueError("give either writers or dst_head_start/num_heads, not both")
    pieces = tuple(writers)

    def eager(pages: PageIndices) -> int:
        return _scatter(staging, k_buffers, v_buffers, pages, page_size, pieces, backend)

    params = ("scatter", pieces, backend)
    return _replayed(params, k_buffers, v_buffers, staging, page_indices, page_size, eager)


def _scatter(
    staging: torch.Tensor,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    page_size: int,
    writers: Sequence[HeadSlice],
    backend: str | None,
) -> int:
    kvset = prepare_kv(k_buffers, v_buffers)
    info = kvset.info
    name = backend_for(info, backend)
    pages = upload_pages(page_indices, page_size, info)
    num_tokens = pages.numel() * page_size
    flat = _flat_bytes(staging, info)
    offset = 0
    for piece in writers:
        kv_slice = piece.destination(page_size)
        check_heads(kv_slice, info, "destination")
        block = flat[offset:]
        word = _word_bytes(kvset, block)
        col_start, num_cols = info.columns(kv_slice, word)
        shape = (2 * info.num_layers, num_tokens, num_cols)
        nbytes = shape[0] * shape[1] * shape[2] * word
        source = _staging_words(block, nbytes, word, shape)
        get_backend(name).scatter(source, KVColumns(kvset.views(word), pages, page_size, col_start))
        offset += nbytes
    return offset


CAPTURED: CapturedCalls[int] = CapturedCalls()


def _capturable(page_indices: PageIndices) -> bool:
    """Host page ids (ids on the device go the eager way)."""
    if isinstance(page_indices, torch.Tensor):
        return page_indices.device.type == "cpu" and page_indices.dim() == 1
    if isinstance(page_indices, np.ndarray):
        return page_indices.ndim == 1
    return isinstance(page_indices, (list, tuple))  # a bad list fails the eager path's check


def _replayed(
    params: tuple[Any, ...],
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    staging: torch.Tensor,
    page_indices: PageIndices,
    page_size: int,
    eager: Callable[[PageIndices], int],
) -> int:
    """`eager(page_indices)`, or its replay from a CUDA graph (`captured`) when the same
    call (these KV lists, this staging memory, as many ids, `params`) came back on
    CUDA with host ids; a replay's usual ids checked and launched in one C call."""
    if not CAPTURED.enabled or not staging.is_cuda:
        return eager(page_indices)
    usual = usual_ids(k_buffers, page_indices, page_size)
    if usual is None and not _capturable(page_indices):
        return eager(page_indices)
    memory = (staging.data_ptr(), staging.numel(), staging.is_contiguous(), staging.dtype)
    count = usual[1] if usual is not None else len(page_indices)
    key = (*params, id(k_buffers), id(v_buffers), *memory, count, page_size)
    named = (k_buffers, v_buffers)
    if usual is not None:
        value = CAPTURED.replay_usual(key, named, usual[0], usual[2])
        if value is not captured.MISSED:
            return value

    def checked(into: torch.Tensor | None) -> torch.Tensor:
        return host_ids(k_buffers, v_buffers, page_indices, page_size, into)

    return CAPTURED.arm(key, named, staging.device, checked, eager, page_indices)()


_DIGEST_SCRATCH = threading.local()  # per thread: scratch for digests gathered first


def slice_digests(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    segments: Sequence[tuple[int, int]],
    kv_slice: KVSlice,
    backend: str | None = None,
) -> list[list[int]]:
    """For each segment (page_start, num_pages) of the page list, the digests that
    `block_digests` gives of its gathered slice, [L0.K, L0.V, L1.K, ...]."""
    return start_slice_digests(
        k_buffers, v_buffers, page_indices, segments, kv_slice, backend
    ).result()


def start_slice_digests(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    segments: Sequence[tuple[int, int]],
    kv_slice: KVSlice,
    backend: str | None = None,
) -> PendingDigests:
    """`slice_digests`, started: with Triton, read in place from the pages in one launch
    on the current stream (nothing gathered; the page ids and segments go up in one
    copy) and waited for by `result()`, so other work can be issued meanwhile;
    elsewhere, each segment gathered into scratch memory and digested at once. The
    values are the same either way."""
    kvset = prepare_kv(k_buffers, v_buffers)
    info = kvset.info
    check_heads(kv_slice, info, "source")
    name = backend_for(info, backend)
    page_size = kv_slice.page_size
    pages = checked_pages(page_indices, page_size, info)
    check_segments(segments, pages.numel())
    if name == "triton" and kvset.max_word >= 4 and info.head_bytes % 4 == 0 and segments:
        from pdctl.staging.kernels.digests import launch_page_digest_sums

        views = kvset.views(4)
        col_start, num_cols = info.columns(kv_slice, 4)
        rows = page_rows(views, pages, col_start)
        sums = launch_page_digest_sums(rows, list(segments), page_size, num_cols)
        words = [count * page_size * num_cols for _, count in segments]
        return PendingDigests(sums, words, len(views))
    pages = pages.to(device=info.device, dtype=torch.int64, non_blocking=True)
    digests = []
    for start, count in segments:  # each gathered into scratch memory, then digested
        nbytes = 2 * info.num_layers * count * page_size * kv_slice.num_heads * info.head_bytes
        scratch = _digest_scratch(info.device, nbytes)
        gather_slice(k_buffers, v_buffers, pages[start : start + count], scratch, kv_slice, name)
        digests.append(block_digests(scratch, info.num_layers, backend=name))
    return PendingDigests(None, [], 2 * info.num_layers, ready=digests)


def _digest_scratch(device: torch.device, nbytes: int) -> torch.Tensor:
    """`nbytes` of this thread's scratch on `device`, grown when too small (its pages
    stay touched: a fresh allocation per segment would fault them in every time)."""
    if not hasattr(_DIGEST_SCRATCH, "digest"):
        _DIGEST_SCRATCH.digest = {}
    cache: dict[torch.device, torch.Tensor] = _DIGEST_SCRATCH.digest
    buffer = cache.get(device)
    if buffer is None or buffer.numel() < nbytes:
        buffer = cache[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer[:nbytes]


__all__ = [
    "KVInfo",
    "KVSet",
    "KVSlice",
    "PageIndices",
    "PendingDigests",
    "checked_pages",
    "describe_kv",
    "gather_all_layers_to_staging",
    "gather_slice",
    "prepare_kv",
    "scatter_slice",
    "scatter_staging_to_kv",
    "slice_digests",
    "start_slice_digests",
    "upload_pages",
]
