"""The torch kernel backend: runs on every device torch supports (CPU, NPU, ...).

It is also the fallback where Triton has no backend. Rows are selected with
`index_select` / `index_copy_` over views chosen so that each copied chunk is as
large and contiguous as the layout allows (see `_plan`): whole pages when every
column of a row is copied, one row of a [pool_tokens * groups, k] view when the
columns are an aligned head group, which takes torch's row-copy fast path instead
of an element-wise strided loop.

torch's index ops move element by element, so a chunk is copied as the widest words
that divide it (`_as_words`: int64, a quarter of a bf16 chunk's elements). Scatter
is the slower one (`index_copy_`): on the CPU a small chunk (page 1) is instead one
numpy item of the chunk's size, which numpy's fancy assignment moves with one memcpy,
the index split over torch's intra-op threads (numpy lets the GIL go while it copies).

On the CPU, where the C copy is built (`native`), it does both directions instead:
a memcpy per chunk with rows prefetched ahead, which the index ops above do not
match on small chunks. The index ops remain the path elsewhere, and here where no C
compiler is found.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pdctl.staging.kernels import native
from pdctl.staging.kernels.base import BufferCache, KernelBackend, KVColumns


def token_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[num_pages] page ids -> [num_pages * page_size] pool rows."""
    if page_size == 1:
        return pages
    offsets = torch.arange(page_size, device=pages.device, dtype=pages.dtype)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)


def _shared_view(buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
    """One 2-D view over every buffer when all sit in one storage at a constant stride.

    The embedded engine allocates K and V of all layers as one tensor, so the
    buffers k0, v0, k1, v1, ... are `stride_rows` rows apart and one index op can
    serve them all. Returns (view, stride_rows) or None.
    """
    first = buffers[0]
    if len(buffers) == 1:
        return first, first.shape[0]
    row_bytes = first.shape[1] * first.element_size()
    step = buffers[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % row_bytes or step // row_bytes < first.shape[0]:
        return None
    storage = first.untyped_storage().data_ptr()
    for i, buffer in enumerate(buffers):
        if buffer.untyped_storage().data_ptr() != storage:
            return None
        if buffer.data_ptr() - first.data_ptr() != i * step:
            return None
    stride_rows = step // row_bytes
    total_rows = stride_rows * (len(buffers) - 1) + first.shape[0]
    return torch.as_strided(first, (total_rows, first.shape[1]), (first.shape[1], 1)), stride_rows


_SHARED_VIEWS: BufferCache[tuple[torch.Tensor, int] | None] = BufferCache(_shared_view)


def _plan(
    kv: KVColumns, staging: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """2-D views, the index into them, and staging reshaped to match.

    Chunks, from the largest to the smallest:
      whole rows, page_size > 1:  one chunk per page  (page_size x row bytes)
      aligned column group:       one chunk per token (the group's bytes)
      anything else:              a strided column slice per token
    When the buffers share one storage (see `_shared_view`), all of them are served
    by a single view and index.
    """
    buffers, pages, page_size, col_start = kv.buffers, kv.pages, kv.page_size, kv.col_start
    num_buffers, _, num_cols = staging.shape
    row_words = buffers[0].shape[1]
    shared = _SHARED_VIEWS.get(buffers)
    if num_cols == row_words and page_size > 1:
        chunk = page_size * row_words
        out = staging.view(num_buffers, -1, chunk)
        if shared is not None and shared[1] % page_size == 0:
            view, stride_rows = shared
            index = _spread(pages, num_buffers, stride_rows // page_size)
            return [view.view(-1, chunk)], index, out.view(1, -1, chunk)
        return [b.view(-1, chunk) for b in buffers], pages, out
    rows = token_rows(pages, page_size)
    if row_words % num_cols == 0 and col_start % num_cols == 0:
        groups = row_words // num_cols
        if shared is not None:
            view, stride_rows = shared
            index = _spread(rows, num_buffers, stride_rows) * groups + col_start // num_cols
            return [view.view(-1, num_cols)], index, staging.view(1, -1, num_cols)
        index = rows * groups + col_start // num_cols if groups > 1 else rows
        return [b.view(-1, num_cols) for b in buffers], index, staging
    return [b[:, col_start : col_start + num_cols] for b in buffers], rows, staging


def _spread(index: torch.Tensor, num_buffers: int, stride: int) -> torch.Tensor:
    """The same index in each of `num_buffers` blocks `stride` apart, block-major."""
    starts = torch.arange(num_buffers, device=index.device, dtype=index.dtype) * stride
    return (starts[:, None] + index[None, :]).reshape(-1)


def _as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same bytes as int64 words (int32 where 8 does not divide a row), for all the
    tensors or none: copying words is bitwise and moves fewer, wider elements."""
    for word in (torch.int64, torch.int32):
        size = word.itemsize
        if all(_divides(t, size) for t in tensors):
            return tuple(t.view(word) for t in tensors)
    return tensors


def _divides(tensor: torch.Tensor, size: int) -> bool:
    """`tensor` viewed as `size`-byte words: last dimension contiguous, and its length,
    offset and every other stride whole words."""
    item = tensor.element_size()
    if tensor.dim() < 1 or item >= size or tensor.stride(-1) != 1:
        return False
    strides = [tensor.stride(d) * item for d in range(tensor.dim() - 1)]
    lengths = [tensor.shape[-1] * item, tensor.storage_offset() * item, *strides]
    return all(n % size == 0 for n in lengths)


# CPU scatters of small chunks by numpy (False: index_copy_ over words, as on other
# devices). Measured on 2 cores: numpy wins at page 1 (256-byte chunks: 0.33 against
# 0.30 of a copy), index_copy_ over words at page 64 (16 KiB chunks: 0.64-0.74
# against 0.43-0.49).
NUMPY_SCATTER = True
NUMPY_CHUNK_MAX = 4096  # bytes
# Below this many bytes a part, a scatter runs on the calling thread (the hand-off
# costs more than it saves).
PARALLEL_BYTES = 1 << 20
_pool: tuple[ThreadPoolExecutor, int] | None = None


def _threads() -> tuple[ThreadPoolExecutor, int]:
    """A pool for the parts of a scatter past the first, and how many parts at most."""
    global _pool
    if _pool is None:
        workers = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
        _pool = ThreadPoolExecutor(max(1, workers - 1), thread_name_prefix="pdctl-scatter"), workers
    return _pool


def _row_items(tensor: torch.Tensor) -> np.ndarray:
    """A CPU [rows, cols] tensor (last dimension contiguous) as a 1-D numpy view of
    `rows` items, each a whole row's bytes (numpy copies one item with one memcpy)."""
    raw = tensor.view(torch.uint8).numpy()  # [rows, row bytes]
    return raw.view(np.dtype((np.void, raw.shape[1])))[:, 0]


def _scatter_cpu(view: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """view[index[i]] = source[i] for every row i, by numpy, on up to torch's threads."""
    target, rows, where = _row_items(view), _row_items(source), index.numpy()
    threads, most = _threads()
    parts = min(most, max(1, source.numel() * source.element_size() // max(1, PARALLEL_BYTES)))
    if parts == 1:
        target[where] = rows
        return
    bounds = np.linspace(0, len(where), parts + 1).astype(np.int64)
    spans = list(itertools.pairwise(bounds.tolist()))
    futures = [threads.submit(target.__setitem__, where[a:b], rows[a:b]) for a, b in spans[1:]]
    a, b = spans[0]
    target[where[a:b]] = rows[a:b]
    for future in futures:
        future.result()


class TorchKernels(KernelBackend):
    name = "torch"

    def gather(self, kv: KVColumns, staging: torch.Tensor) -> None:
        if staging.device.type == "cpu" and native.copy_rows(kv, staging, to_staging=True):
            return
        views, index, out = _plan(kv, staging)
        for i, view in enumerate(views):
            wide_view, wide_out = _as_words(view, out[i])
            torch.index_select(wide_view, 0, index, out=wide_out)

    def scatter(self, staging: torch.Tensor, kv: KVColumns) -> None:
        if staging.device.type == "cpu" and native.copy_rows(kv, staging, to_staging=False):
            return
        views, index, source = _plan(kv, staging)
        for i, view in enumerate(views):
            rows = source[i]
            chunk = rows.shape[-1] * rows.element_size()
            cpu = view.device.type == "cpu" and NUMPY_SCATTER and chunk <= NUMPY_CHUNK_MAX
            if cpu and view.stride(-1) == 1 and rows.stride(-1) == 1:
                _scatter_cpu(view, index, rows)
            else:
                wide_view, wide_rows = _as_words(view, rows)
                wide_view.index_copy_(0, index, wide_rows)
