"""Page ids from the host: checked (in range of the pool, none twice) before a kernel
reads them, and moved where the kernel wants them.

Every host page list passes `check_host_pages` (one pass in C where `native` is
built); `upload_pages` is the eager paths' way to the device, `host_ids` a graph
replay's (the ids written into the replay's pinned slot in the check's pass),
`page_array` the mapped write's (int64 numpy, which it uploads with its tables).
Ids already on the device are taken as they are: checking them would need a
device synchronize.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NoReturn

import numpy as np
import torch

from pdctl.staging.kernels import native
from pdctl.staging.kernels.kvset import KVInfo, prepare_kv

PageIndices = torch.Tensor | Sequence[int] | np.ndarray


def upload_pages(page_indices: PageIndices, page_size: int, info: KVInfo) -> torch.Tensor:
    """Page ids -> int64 tensor on the KV device; host inputs are range- and duplicate-checked.

    A pinned host tensor uploads asynchronously; ids already on the device are
    taken as they are (checking them would need a device synchronize).
    """
    return checked_pages(page_indices, page_size, info).to(
        device=info.device, dtype=torch.int64, non_blocking=True
    )


def checked_pages(
    page_indices: PageIndices, page_size: int, info: KVInfo, into: torch.Tensor | None = None
) -> torch.Tensor:
    """Page ids as a 1-D integer tensor where they are; host ids range- and
    duplicate-checked, and copied to `into` (int64, as long) where it is given."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages = torch.as_tensor(page_indices)
    if pages.dim() != 1 or pages.dtype.is_floating_point or pages.dtype == torch.bool:
        raise ValueError(
            f"page_indices must be a 1-D integer sequence, got {pages.dtype} {tuple(pages.shape)}"
        )
    if pages.device.type == "cpu" and pages.numel():
        check_host_pages(pages, info.pool_tokens // page_size, into)
    return pages


_SCRATCH = threading.local()  # per thread: the page check's stamps


def _scratch(num_pages: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    stamps: np.ndarray | None = getattr(_SCRATCH, "stamps", None)
    order: np.ndarray | None = getattr(_SCRATCH, "order", None)
    if stamps is None or len(stamps) < num_pages:
        stamps = _SCRATCH.stamps = np.empty(max(num_pages, 1024), dtype=np.int32)
    if order is None or len(order) < count:
        order = _SCRATCH.order = np.arange(max(count, 1024), dtype=np.int32)
    return stamps, order[:count]


def check_host_pages(
    ids: np.ndarray | torch.Tensor, num_pages: int, into: torch.Tensor | None = None
) -> None:
    """Range and duplicate check (this runs on every host page list), and the ids'
    copy to `into` (an int64 CPU tensor as long) where it is given, in the same pass
    where the check runs in C.

    A pool at most 16x the list: mark a pool-sized bool array and count (two fast
    passes). A larger pool (a million pages): each position stamps its page with its
    own index in a per-thread scratch array; a page named twice keeps only the later
    stamp, so reading the stamps back differs exactly where ids repeat, and nothing
    proportional to the pool is touched.
    """
    found = native.check_ids(ids, num_pages, into)  # one pass in C, where it is built
    if found is not None and found[0] < 0:
        return  # the common case: every id good (and copied)
    pages = ids.numpy() if isinstance(ids, torch.Tensor) else ids
    if found is None and into is not None:  # not built, or ids of another integer type
        into.numpy()[:] = pages
    if found is not None:
        position, repeated = found
        if not repeated:
            _raise_outside(pages, num_pages)
        raise ValueError(f"page index {int(pages[position])} appears more than once")
    if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
        _raise_outside(pages, num_pages)
    if num_pages <= 16 * len(pages):
        seen = np.zeros(num_pages, dtype=np.bool_)
        seen[pages] = True
        unique = np.count_nonzero(seen) == len(pages)
    else:
        stamps, order = _scratch(num_pages, len(pages))
        stamps[pages] = order
        unique = np.array_equal(stamps[pages], order)
    if not unique:
        values, counts = np.unique(pages, return_counts=True)
        raise ValueError(f"page index {int(values[counts > 1][0])} appears more than once")


def page_array(pages: PageIndices, num_pages: int) -> np.ndarray | torch.Tensor:
    """Host page ids as int64 numpy, range- and duplicate-checked against `num_pages`;
    ids already on a device as they are (checking them would wait for the device)."""
    if isinstance(pages, torch.Tensor):
        if pages.dim() != 1 or pages.dtype.is_floating_point or pages.dtype == torch.bool:
            raise ValueError(
                f"page ids must be a 1-D integer sequence, got {pages.dtype} {tuple(pages.shape)}"
            )
        if pages.device.type != "cpu":
            return pages
        ids = pages.numpy().astype(np.int64, copy=False)
    else:
        ids = np.asarray(pages, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"page ids must be a 1-D integer sequence, got shape {ids.shape}")
    if len(ids):
        check_host_pages(ids, num_pages)
    return ids


def _raise_outside(pages: np.ndarray, num_pages: int) -> NoReturn:
    low, high = int(pages.min()), int(pages.max())
    raise ValueError(
        f"page index {low if low < 0 else high} is outside the pool's {num_pages} pages"
    )


def usual_ids(
    k_buffers: Sequence[torch.Tensor], page_indices: PageIndices, page_size: int
) -> tuple[int, int, int] | None:
    """(address, count, pages in the pool) of a replay's usual ids: a 1-D contiguous
    int64 CPU tensor of at least one id, for KV lists that are the very tensors a
    replay's shape was captured with (`captured._Shape.names`), so that their first
    dimension is the pool's tokens. None for anything else (the full path).

    Every tensor property read costs about a microsecond on a slow host, and this
    runs on every replay (an H200's host spent 31-35 us a call on the check of 8,192
    ids; `benchmarks/staging_e2e_profile.py` times a call's host work)."""
    if (
        type(page_indices) is torch.Tensor
        and page_indices.dtype is torch.int64
        and page_indices.is_cpu
        and page_indices.dim() == 1
        and page_indices.is_contiguous()
        and page_size >= 1
        and len(k_buffers)
    ):
        count = len(page_indices)
        if count:
            return page_indices.data_ptr(), count, k_buffers[0].shape[0] // page_size
    return None


def host_ids(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    page_size: int,
    into: torch.Tensor | None,
) -> torch.Tensor:
    """The host ids as a CPU tensor, checked as `upload_pages` checks them; written to
    `into` (a replay's pinned slot) in the check's pass where it is given.

    A replay's usual ids (`usual_ids`, as long as the slot) go straight to the C check.
    Anything else, and any id the C check refuses, takes the full path, which raises
    the precise error."""
    usual = usual_ids(k_buffers, page_indices, page_size) if into is not None else None
    if usual is not None and into is not None:
        address, count, num_pages = usual
        if into.dtype is torch.int64 and into.is_contiguous() and into.numel() == count:
            found = native.check_at(address, count, num_pages, into.data_ptr())
            if found is not None and found[0] < 0:
                return into
    pages = checked_pages(page_indices, page_size, prepare_kv(k_buffers, v_buffers).info, into)
    return into if into is not None else pages.to(torch.int64)
