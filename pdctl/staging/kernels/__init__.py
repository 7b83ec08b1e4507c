"""Checked gather/scatter between paged KV buffers and staging, on any device.

`gather_all_layers_to_staging` copies one head slice of every layer (K and V) for
a list of pages into a contiguous staging block; `scatter_staging_to_kv` copies a
block (or a region with several writers' blocks) back into KV pages. The device
comes from the KV buffers; staging on another device is an error. Arguments are
validated here, then a backend (`triton` on CUDA and XPU, `torch` elsewhere) does
the copy on integer views, so results are bit-identical across backends.

Shapes:
    k_buffers[l], v_buffers[l]   [pool_tokens, num_kv_heads, head_dim], one per layer
    page_indices                 [num_pages] page ids (token row = page * page_size + i)
    staging block                L x (K, V) x [num_pages * page_size, num_heads, head_dim]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.digest import block_digests, digests_of_sums
from pdctl.staging.kernels import captured
from pdctl.staging.kernels.base import get_backend
from pdctl.staging.kernels.captured import CapturedCalls
from pdctl.staging.kernels.checks import check_heads, check_segments
from pdctl.staging.kernels.digest_tables import ALIGNED, DIGEST_TABLES
from pdctl.staging.kernels.dispatch import backend_for
from pdctl.staging.kernels.kvset import WORD_DTYPES, KVInfo, KVSet, describe_kv, prepare_kv
from pdctl.staging.kernels.pages import (
    PageIndices,
    checked_pages,
    host_ids,
    upload_pages,
    usual_ids,
)
from pdctl.staging.layout import HeadSlice


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
    """Gather heads [src_head_start, +num_heads) of every layer's K and V; returns bytes.

    On CUDA a call that comes back the same is replayed from a graph (`captured`)."""

    heads = (src_head_start, num_heads)

    def eager(pages: PageIndices) -> int:
        return _gather(k_buffers, v_buffers, pages, staging, heads, page_size, backend)

    params = ("gather", *heads, backend)
    return _replayed(params, k_buffers, v_buffers, staging, page_indices, page_size, eager)


def _gather(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    staging: torch.Tensor,
    heads: tuple[int, int],  # (first source head, how many)
    page_size: int,
    backend: str | None,
) -> int:
    src_head_start, num_heads = heads
    kvset = prepare_kv(k_buffers, v_buffers)
    info = kvset.info
    check_heads(src_head_start, num_heads, info, "source")
    name = backend_for(info, backend)
    pages = upload_pages(page_indices, page_size, info)
    num_tokens = pages.numel() * page_size
    flat = _flat_bytes(staging, info)
    word = _word_bytes(kvset, flat)
    head_words = info.head_dim * info.elem_bytes // word
    shape = (2 * info.num_layers, num_tokens, num_heads * head_words)
    nbytes = shape[0] * shape[1] * shape[2] * word
    out = _staging_words(flat, nbytes, word, shape)
    get_backend(name).gather(kvset.views(word), pages, page_size, out, src_head_start * head_words)
    return nbytes


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
    """Scatter one block (dst_head_start, num_heads) or a region of several writers' blocks.

    With `writers`, the region holds one block per writer in order (see `layout`),
    each scattered into its own destination heads. Returns the bytes consumed. On
    CUDA a call that comes back the same is replayed from a graph (`captured`).
    """
    params: tuple[Any, ...]
    pieces: tuple[HeadSlice, ...] | None = None  # one block's: made by the eager call (a
    # replay needs none, and each object costs a microsecond of a slow host's replay)
    if writers is None:
        if dst_head_start is None or num_heads is None:
            raise ValueError("give dst_head_start and num_heads, or writers")
        params = ("scatter", dst_head_start, num_heads, backend)  # ints hash at C speed
        block = (dst_head_start, num_heads)
    elif dst_head_start is not None or num_heads is not None:
        raise ValueError("give either writers or dst_head_start/num_heads, not both")
    else:
        pieces = tuple(writers)
        params = ("scatter", pieces, backend)

    def eager(pages: PageIndices) -> int:
        blocks = pieces if pieces is not None else (HeadSlice(0, 0, *block),)
        return _scatter(staging, k_buffers, v_buffers, pages, page_size, blocks, backend)

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
        check_heads(piece.dst_head_start, piece.num_heads, info, "destination")
        block = flat[offset:]
        word = _word_bytes(kvset, block)
        head_words = info.head_dim * info.elem_bytes // word
        shape = (2 * info.num_layers, num_tokens, piece.num_heads * head_words)
        nbytes = shape[0] * shape[1] * shape[2] * word
        source = _staging_words(block, nbytes, word, shape)
        buffers = kvset.views(word)
        get_backend(name).scatter(
            source, buffers, pages, page_size, piece.dst_head_start * head_words
        )
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
    if usual is not None:
        value = CAPTURED.replay_usual(key, (k_buffers, v_buffers), usual[0], usual[2])
        if value is not captured.MISSED:
            return value
    return CAPTURED.arm(
        key,
        (k_buffers, v_buffers),
        staging.device,
        lambda into: host_ids(k_buffers, v_buffers, page_indices, page_size, into),
        eager,
        page_indices,
    )()


_DIGEST_SCRATCH = threading.local()  # per thread: scratch for digests gathered first


@dataclass
class PendingDigests:
    """Page digests under way on the device (`start_page_digests`); `result()` waits."""

    sums: torch.Tensor | None  # [segments * buffers] int64 weighted sums, on the device
    words: list[int]  # per segment: words per chunk
    num_buffers: int
    ready: list[list[int]] | None = None
    host: torch.Tensor | None = None  # the sums in pinned host memory (`stage_to_host`)
    copied: Any = None  # a device event recorded after the copy to `host`
    rung: bool = False  # the launch also rang a doorbell with the sums (`kernels.bell`)

    def stage_to_host(self) -> None:
        """Queue the sums' copy to pinned host memory behind the kernel (CUDA only), so
        that `result()` after the stream passed it reads host memory, not the device."""
        if self.sums is None or self.host is not None or self.sums.device.type != "cuda":
            return
        self.host = torch.empty(self.sums.shape, dtype=self.sums.dtype, pin_memory=True)
        self.host.copy_(self.sums, non_blocking=True)
        self.copied = dev.create_device_event(self.sums.device)
        self.copied.record(dev.current_device_stream(self.sums.device))

    def result(self) -> list[list[int]]:
        """Per segment, the digests [L0.K, L0.V, L1.K, ...] (one host synchronisation)."""
        if self.ready is None:
            assert self.sums is not None
            if self.host is not None and self.copied is not None:
                self.copied.synchronize()
                sums = self.host.numpy()
            else:
                sums = self.sums.cpu().numpy()
            width = self.num_buffers
            lengths = np.repeat(np.asarray(self.words, dtype=np.uint64), width)
            flat = digests_of_sums(sums[: len(lengths)], lengths)
            self.ready = [flat[i * width : (i + 1) * width] for i in range(len(self.words))]
        return self.ready


def page_digests(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    segments: Sequence[tuple[int, int]],
    *,
    head_start: int,
    num_heads: int,
    page_size: int,
    backend: str | None = None,
) -> list[list[int]]:
    """For each segment (page_start, num_pages) of the page list, the digests that
    `block_digests` gives of its gathered head slice, [L0.K, L0.V, L1.K, ...]."""
    return start_page_digests(
        k_buffers,
        v_buffers,
        page_indices,
        segments,
        head_start=head_start,
        num_heads=num_heads,
        page_size=page_size,
        backend=backend,
    ).result()


def start_page_digests(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    segments: Sequence[tuple[int, int]],
    *,
    head_start: int,
    num_heads: int,
    page_size: int,
    backend: str | None = None,
) -> PendingDigests:
    """`page_digests`, started: with Triton, read in place from the pages in one launch
    on the current stream (nothing gathered; the page ids and segments go up in one
    copy) and waited for by `result()`, so other work can be issued meanwhile;
    elsewhere, each segment gathered into scratch memory and digested at once. The
    values are the same either way."""
    kvset = prepare_kv(k_buffers, v_buffers)
    info = kvset.info
    check_heads(head_start, num_heads, info, "source")
    name = backend_for(info, backend)
    pages = checked_pages(page_indices, page_size, info)
    check_segments(segments, pages.numel())
    head_bytes = info.head_dim * info.elem_bytes
    if name == "triton" and kvset.max_word >= 4 and head_bytes % 4 == 0 and segments:
        from pdctl.staging.kernels.digests import PageRows, launch_page_digest_sums

        views = kvset.views(4)
        num_cols = num_heads * head_bytes // 4
        rows = PageRows(
            DIGEST_TABLES.get(views),
            pages,
            views[0].shape[1],
            head_start * head_bytes // 4,
            ALIGNED.get(views),
        )
        sums = launch_page_digest_sums(
            rows, list(segments), num_buffers=len(views), page_size=page_size, num_cols=num_cols
        )
        words = [count * page_size * num_cols for _, count in segments]
        return PendingDigests(sums, words, len(views))
    pages = pages.to(device=info.device, dtype=torch.int64, non_blocking=True)
    digests = []
    for start, count in segments:  # each gathered into scratch memory, then digested
        nbytes = 2 * info.num_layers * count * page_size * num_heads * head_bytes
        scratch = _digest_scratch(info.device, nbytes)
        gather_all_layers_to_staging(
            k_buffers,
            v_buffers,
            pages[start : start + count],
            scratch,
            src_head_start=head_start,
            num_heads=num_heads,
            page_size=page_size,
            backend=name,
        )
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
    "PageIndices",
    "PendingDigests",
    "checked_pages",
    "describe_kv",
    "gather_all_layers_to_staging",
    "page_digests",
    "prepare_kv",
    "scatter_staging_to_kv",
    "start_page_digests",
    "upload_pages",
]
