"""A direct KV write and its page digests in one read of the bytes.

Between two processes of one host whose transport maps the peer's device memory
here (`Transport.mapped_view`), a request's KV need not go through descriptors and
a copy followed by a second pass that digests the source: one launch reads each
word of the slice once, stores it at the peer's row and adds it to the segment's
digest, the value `slice_digests` gives for the source and the peer computes over
the pages it received. With Triton that is the page-digest kernel with its store
on (`digests.launch_page_digest_sums(target=...)`); elsewhere the torch reference
copies, then digests. Both leave the same bytes and the same digests.

    source row t (page p, slot i):  | .. | heads [head_start, +num_heads) | .. |  src heads
    target row t' (page q, slot i): | .. | heads [target.head_start, +n)   | .. |  dst heads

What this does not know: how the peer's memory was mapped, or who is told.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdctl.staging.doorbell import SUMS
from pdctl.staging.kernels import PendingDigests, prepare_kv, start_slice_digests
from pdctl.staging.kernels.captured import CapturedCalls, checked_ids
from pdctl.staging.kernels.checks import check_heads, check_segments
from pdctl.staging.kernels.digest_tables import ALIGNED, DIGEST_TABLES, PageRows, page_rows
from pdctl.staging.kernels.dispatch import backend_for
from pdctl.staging.kernels.kvset import KVInfo
from pdctl.staging.kernels.pages import PageIndices, page_array
from pdctl.staging.kernels.write_slots import Bucket, capture_writes
from pdctl.staging.layout import KVSlice


@dataclass(frozen=True)
class PeerPages:
    """A direct write's destination, as this process sees it.

    `buffers`: the peer's KV buffers in staging order (k0, v0, k1, v1, ...), each
    [pool_tokens, heads, head_dim] of the source's dtype (give the same list object
    on every call: it keys the cached pointer table); `pages`: the peer's page for
    each source page; `head_start`: the peer's first head the slice lands on.
    """

    buffers: Sequence[torch.Tensor]
    pages: PageIndices
    head_start: int


@dataclass(frozen=True)
class _Checked:
    table: torch.Tensor  # [buffers] int64 addresses of the int32 views
    views: list[torch.Tensor]  # [pool_tokens, row_words] int32
    num_heads: int
    num_pages: int
    aligned: bool  # every buffer starts at 16 bytes

    def rows(self, pages: np.ndarray | torch.Tensor, col_start: int) -> PageRows:
        """The rows of `pages` here, from int32 column `col_start` on."""
        return PageRows(self.table, pages, self.views[0].shape[1], col_start, self.aligned)


def _check_target(
    buffers: Sequence[torch.Tensor], info: KVInfo, dtype: torch.dtype, page_size: int
) -> _Checked:
    if len(buffers) != 2 * info.num_layers:
        raise ValueError(
            f"the target has {len(buffers)} buffers; the source's {info.num_layers} layers "
            f"need {2 * info.num_layers} (K and V each)"
        )
    first = buffers[0]
    for i, buffer in enumerate(buffers):
        if (
            buffer.dim() != 3
            or buffer.dtype != dtype
            or buffer.device != info.device
            or buffer.shape != first.shape
            or buffer.shape[2] != info.head_dim
            or not buffer.is_contiguous()
        ):
            raise ValueError(
                f"target buffer {i} is {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}; "
                f"every one must be a contiguous [pool_tokens, heads, {info.head_dim}] "
                f"{dtype} on {info.device}"
            )
    if first.shape[0] % page_size:
        raise ValueError(f"target pool of {first.shape[0]} tokens is not whole {page_size}-pages")
    views = [b.view(b.shape[0], -1).view(torch.int32) for b in buffers]
    num_heads, num_pages = int(first.shape[1]), first.shape[0] // page_size
    return _Checked(DIGEST_TABLES.get(views), views, num_heads, num_pages, ALIGNED.get(views))


_TARGET_LOCK = threading.Lock()
_CHECKED: dict[tuple[int, int], tuple[Sequence[torch.Tensor], _Checked]] = {}


def _known_target(buffers: Sequence[torch.Tensor], page_size: int) -> _Checked | None:
    """The checked target for this buffer list, where it was checked before."""
    with _TARGET_LOCK:
        entry = _CHECKED.get((id(buffers), page_size))
    return entry[1] if entry is not None and entry[0] is buffers else None


def _target(
    buffers: Sequence[torch.Tensor], info: KVInfo, dtype: torch.dtype, page_size: int
) -> _Checked:
    """The target checked (once per list and page size: `_known_target` after)."""
    key = (id(buffers), page_size)
    checked = _check_target(buffers, info, dtype, page_size)
    with _TARGET_LOCK:
        if len(_CHECKED) >= 64:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = (buffers, checked)
    return checked


@dataclass(frozen=True)
class _Write:
    """A Triton write's source and target as the kernel reads them, in int32 words."""

    views: list[torch.Tensor]  # the source's [pool_tokens, row_words] int32 views
    target: _Checked
    page_size: int
    col_starts: tuple[int, int]  # the slice's first column in a source row, in a target row
    num_cols: int  # the slice's columns in a row


def arm_slice_write(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    target: PeerPages,
    segments: Sequence[tuple[int, int]],
    kv_slice: KVSlice,
    *,
    backend: str | None = None,
    bell: tuple[int, int] | None = None,
) -> Callable[[], PendingDigests]:
    """The slice of every layer's K and V for `page_indices` written into the target's
    pages, and each segment's (page_start, num_pages) page digests of what was written:
    the checks and host work now (a replay's ids in its pinned slot), the launch by the
    function returned, at once or later, on the current stream of whichever thread calls
    it (the write reads the pages when the stream gets there). Triton: one launch; the
    bytes are in place once `result()` returns. Elsewhere the copies and digests are
    done when the launch returns.

    `bell`: (a doorbell slot's device address, its sequence number): with Triton the
    launch ends by ringing it with the digest sums (`kernels.bell`; the result says
    `rung`); elsewhere nothing rings (the caller rings from the host)."""
    # looked up before any call leaves this file: an arm enters it twice in all, here
    # and in `_arm` (docs/structure.md, "One KV page's walk")
    known = _known_target(target.buffers, kv_slice.page_size)
    kvset = prepare_kv(k_buffers, v_buffers)
    info = kvset.info
    check_heads(kv_slice, info, "source")
    page_size, num_heads = kv_slice.page_size, kv_slice.num_heads
    checked = known or _target(target.buffers, info, k_buffers[0].dtype, page_size)
    if num_heads < 1 or target.head_start < 0 or target.head_start + num_heads > checked.num_heads:
        raise ValueError(
            f"target heads [{target.head_start}, {target.head_start + num_heads}) are outside "
            f"the target's {checked.num_heads} KV heads"
        )
    pages = page_array(page_indices, info.pool_tokens // page_size)
    dst_pages = page_array(target.pages, checked.num_pages)
    if len(dst_pages) != len(pages):
        raise ValueError(f"the target names {len(dst_pages)} pages for the source's {len(pages)}")
    check_segments(segments, len(pages))
    name = backend_for(info, backend)
    if name == "triton" and kvset.max_word >= 4 and info.head_bytes % 4 == 0 and segments:
        head_words = info.head_bytes // 4
        col_starts = (kv_slice.head_start * head_words, target.head_start * head_words)
        write = _Write(kvset.views(4), checked, page_size, col_starts, num_heads * head_words)
        return _arm(write, (pages, dst_pages), segments, bell)

    def reference() -> PendingDigests:
        write_pages_reference(k_buffers, v_buffers, pages, target, kv_slice)
        return start_slice_digests(k_buffers, v_buffers, pages, segments, kv_slice, name)

    return reference


def start_slice_write(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    target: PeerPages,
    segments: Sequence[tuple[int, int]],
    kv_slice: KVSlice,
    *,
    backend: str | None = None,
    bell: tuple[int, int] | None = None,
) -> PendingDigests:
    """`arm_slice_write`, launched at once on the current stream."""
    armed = arm_slice_write(
        k_buffers, v_buffers, page_indices, target, segments, kv_slice, backend=backend, bell=bell
    )
    return armed()


def _arm(
    write: _Write,
    page_lists: tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor],
    segments: Sequence[tuple[int, int]],
    bell: tuple[int, int] | None,
) -> Callable[[], PendingDigests]:
    """The Triton path: source and target (page ids, first int32 column) in one launch,
    and the doorbell after it.

    Host page ids on CUDA go through `WRITES`, in bucketed shapes (`write_slots.Bucket`):
    a write whose bucket came back is replayed from a CUDA graph holding the ids' upload,
    the launch, the sums, their copy to pinned host memory and the ring, so its host work
    is a copy of the ids and one graph launch; the graph is captured when the write is
    armed, never when it launches. The function returned is `WRITES`'s own (a replay
    makes the digests of this write's `words`: `WriteSlot.hand_out`), so a launch does
    not come back here."""
    from pdctl.staging.kernels.digests import segment_table

    pages, dst_pages = page_lists
    device = write.views[0].device
    segments = list(segments)
    words = [count * write.page_size * write.num_cols for _, count in segments]
    count = len(segments) * len(write.views)  # the sums the write's digests come from
    ring = np.asarray([*bell, count] if bell is not None else [], dtype=np.int64)
    if not isinstance(pages, np.ndarray):  # ids already on the device: as they are
        rings = None if bell is None else (_uploaded(ring, device), 0)
        return lambda: _launch(write, segments, (None, pages, dst_pages), rings, words)
    assert isinstance(dst_pages, np.ndarray)  # both host ids, or both device ones
    table = segment_table(segments, write.page_size)
    parts = [table, pages, dst_pages, ring]
    bucket, joined, spans = Bucket.tables(segments, len(write.views), parts)
    launch = functools.partial(_launch, write, bucket.segments)
    # what a graph of the write depends on besides its tensors, and what it sums
    key = (bucket.key, write.page_size, write.col_starts, write.num_cols, bell is not None)
    ahead = bucket.sums

    def eager(ids: np.ndarray | torch.Tensor) -> PendingDigests:
        on_device = _uploaded(ids, device)  # host tables go up; a graph's device ids stay
        described, src, dst = (on_device[start:end] for start, end in spans[:3])
        rings = None if bell is None else (on_device, spans[3][0])
        return launch((described, src, dst), rings, words)

    if not WRITES.enabled or device.type != "cuda":  # graphs are CUDA's
        return lambda: eager(joined)
    named = (write.views, write.target.views)
    host_ids = functools.partial(checked_ids, joined)
    return WRITES.arm(key, named, device, host_ids, eager, joined, ahead=ahead, given=words)


def _launch(
    write: _Write,
    segments: list[tuple[int, int]],
    tables: tuple[torch.Tensor | None, Any, Any],
    rings: Any,
    words: list[int],
) -> PendingDigests:
    """The launch of one write's tables: the page-digest kernel with its store on,
    sized by `segments` (a bucket's, or the write's own), then the ring."""
    from pdctl.staging.kernels.bell import ring_from_device
    from pdctl.staging.kernels.digests import launch_page_digest_sums

    described, src, dst = tables
    source = page_rows(write.views, src, write.col_starts[0])
    target = write.target.rows(dst, write.col_starts[1])
    sums = launch_page_digest_sums(
        source, segments, write.page_size, write.num_cols, target=target, described=described
    )
    if rings is not None:
        ring_from_device(rings[0], rings[1], sums, SUMS)
    return PendingDigests(sums, words, len(write.views), rung=rings is not None)


WRITES: CapturedCalls[PendingDigests] = CapturedCalls(capture=capture_writes)


def _uploaded(ids: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Ids on `device` (host ones copied there; ids already there as they are)."""
    tensor = torch.from_numpy(ids) if isinstance(ids, np.ndarray) else ids
    return tensor.to(device, non_blocking=True)


def write_pages_reference(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    target: PeerPages,
    kv_slice: KVSlice,
) -> None:
    """The write alone, in torch: every buffer's slice rows copied page for page."""
    sources = [b for pair in zip(k_buffers, v_buffers, strict=True) for b in pair]
    device = sources[0].device
    page_size = kv_slice.page_size
    src = torch.as_tensor(page_indices).to(device=device, dtype=torch.int64)
    dst = torch.as_tensor(target.pages).to(device=device, dtype=torch.int64)
    offsets = torch.arange(page_size, device=device)
    src_rows = (src[:, None] * page_size + offsets).reshape(-1)
    dst_rows = (dst[:, None] * page_size + offsets).reshape(-1)
    heads = slice(kv_slice.head_start, kv_slice.head_start + kv_slice.num_heads)
    landing = slice(target.head_start, target.head_start + kv_slice.num_heads)
    for source, buffer in zip(sources, target.buffers, strict=True):
        words, into = _bytes(source), _bytes(buffer)  # bit patterns, never values
        into[dst_rows, landing] = words.index_select(0, src_rows)[:, heads]


def _bytes(buffer: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] -> the same memory as [tokens, heads, head_bytes] uint8."""
    return buffer.view(torch.uint8).view(buffer.shape[0], buffer.shape[1], -1)
