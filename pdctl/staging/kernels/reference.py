"""The torch kernel backend: runs on every device torch supports (CPU, NPU, ...).

It is also the fallback where Triton has no backend. Rows are selected with
`index_select` / `index_copy_` over views chosen so that each copied chunk is as
large and contiguous as the layout allows (see `_plan`): whole pages when every
column of a row is copied, one row of a [pool_tokens * groups, k] view when the
columns are an aligned head group, which takes torch's row-copy fast path instead
of an element-wise strided loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdctl.staging.kernels.base import BufferCache, KernelBackend


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
    buffers: Sequence[torch.Tensor],
    staging: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    col_start: int,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """2-D views, the index into them, and staging reshaped to match.

    Chunks, from the largest to the smallest:
      whole rows, page_size > 1:  one chunk per page  (page_size x row bytes)
      aligned column group:       one chunk per token (the group's bytes)
      anything else:              a strided column slice per token
    When the buffers share one storage (see `_shared_view`), all of them are served
    by a single view and index.
    """
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


class TorchKernels(KernelBackend):
    name = "torch"

    def gather(
        self,
        buffers: Sequence[torch.Tensor],
        pages: torch.Tensor,
        page_size: int,
        staging: torch.Tensor,
        col_start: int,
    ) -> None:
        views, index, out = _plan(buffers, staging, pages, page_size, col_start)
        for i, view in enumerate(views):
            torch.index_select(view, 0, index, out=out[i])

    def scatter(
        self,
        staging: torch.Tensor,
        buffers: Sequence[torch.Tensor],
        pages: torch.Tensor,
        page_size: int,
        col_start: int,
    ) -> None:
        views, index, source = _plan(buffers, staging, pages, page_size, col_start)
        for i, view in enumerate(views):
            view.index_copy_(0, index, source[i])
