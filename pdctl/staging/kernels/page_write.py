"""A direct KV write and its page digests in one read of the bytes.

Between two processes of one host whose transport maps the peer's device memory
here (`Transport.mapped_view`), a request's KV need not go through descriptors and
a copy followed by a second pass that digests the source: one launch reads each
word of the slice once, stores it at the peer's row and adds it to the segment's
digest, the value `page_digests` gives for the source and the peer computes over
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
from typing import Any, ParamSpec

import numpy as np
import torch

from pdctl.staging.doorbell import SUMS
from pdctl.staging.kernels import PendingDigests, prepare_kv, start_page_digests
from pdctl.staging.kernels.captured import CapturedCalls
from pdctl.staging.kernels.checks import check_heads, check_segments
from pdctl.staging.kernels.digest_tables import ALIGNED, DIGEST_TABLES
from pdctl.staging.kernels.dispatch import backend_for
from pdctl.staging.kernels.kvset import KVInfo
from pdctl.staging.kernels.pages import PageIndices, check_host_pages
from pdctl.staging.kernels.write_slots import capture_writes

P = ParamSpec("P")


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
    return _Checked(
        DIGEST_TABLES.get(views),
        views,
        int(first.shape[1]),
        first.shape[0] // page_size,
        ALIGNED.get(views),
    )


_TARGET_LOCK = threading.Lock()
_CHECKED: dict[tuple[int, int], tuple[Sequence[torch.Tensor], _Checked]] = {}


def _target(
    buffers: Sequence[torch.Tensor], info: KVInfo, dtype: torch.dtype, page_size: int
) -> _Checked:
    """The checked target for this buffer list (checked once per list and page size)."""
    key = (id(buffers), page_size)
    with _TARGET_LOCK:
        entry = _CHECKED.get(key)
    if entry is not None and entry[0] is buffers:
        return entry[1]
    checked = _check_target(buffers, info, dtype, page_size)
    with _TARGET_LOCK:
        if len(_CHECKED) >= 64:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = (buffers, checked)
    return checked


def arm_page_write(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    target: PeerPages,
    segments: Sequence[tuple[int, int]],
    *,
    head_start: int,
    num_heads: int,
    page_size: int,
    backend: str | None = None,
    bell: tuple[int, int] | None = None,
) -> Callable[[], PendingDigests]:
    """Heads [head_start, +num_heads) of every layer's K and V for `page_indices`
    written into the target's pages, and each segment's (page_start, num_pages) page
    digests of what was written: the checks and host work now (a replay's ids in its
    pinned slot), the launch by the function returned, at once or later, on the current
    stream of whichever thread calls it (the write reads the pages when the stream gets
    there). Triton: one launch; the bytes are in place once `result()` returns.
    Elsewhere the copies and digests are done when the launch returns.

    `bell`: (a doorbell slot's device address, its sequence number): with Triton the
    launch ends by ringing it with the digest sums (`kernels.bell`; the result says
    `rung`); elsewhere nothing rings (the caller rings from the host)."""
    kvset = prepare_kv(k_buffers, v_buffers)
    info = kvset.info
    check_heads(head_start, num_heads, info, "source")
    checked = _target(target.buffers, info, k_buffers[0].dtype, page_size)
    if num_heads < 1 or target.head_start < 0 or target.head_start + num_heads > checked.num_heads:
        raise ValueError(
            f"target heads [{target.head_start}, {target.head_start + num_heads}) are outside "
            f"the target's {checked.num_heads} KV heads"
        )
    pages = _page_ids(page_indices, info.pool_tokens // page_size)
    dst_pages = _page_ids(target.pages, checked.num_pages)
    if len(dst_pages) != len(pages):
        raise ValueError(f"the target names {len(dst_pages)} pages for the source's {len(pages)}")
    check_segments(segments, len(pages))
    head_bytes = info.head_dim * info.elem_bytes
    name = backend_for(info, backend)
    if name == "triton" and kvset.max_word >= 4 and head_bytes % 4 == 0 and segments:
        word_cols = (head_start * head_bytes // 4, target.head_start * head_bytes // 4)
        num_cols = num_heads * head_bytes // 4
        return _arm(
            kvset.views(4),
            checked,
            (pages, dst_pages),
            segments,
            page_size,
            word_cols,
            num_cols,
            bell,
        )

    def reference() -> PendingDigests:
        write_pages_reference(
            k_buffers,
            v_buffers,
            pages,
            target,
            head_start=head_start,
            num_heads=num_heads,
            page_size=page_size,
        )
        return start_page_digests(
            k_buffers,
            v_buffers,
            pages,
            segments,
            head_start=head_start,
            num_heads=num_heads,
            page_size=page_size,
            backend=name,
        )

    return reference


def _launched_now(
    arm: Callable[P, Callable[[], PendingDigests]],
) -> Callable[P, PendingDigests]:
    @functools.wraps(arm)
    def start(*args: P.args, **kwargs: P.kwargs) -> PendingDigests:
        return arm(*args, **kwargs)()

    start.__doc__ = "`arm_page_write`, launched at once on the current stream."
    return start


start_page_write = _launched_now(arm_page_write)


def _arm(
    views: list[torch.Tensor],
    checked: _Checked,
    page_lists: tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor],
    segments: Sequence[tuple[int, int]],
    page_size: int,
    col_starts: tuple[int, int],
    num_cols: int,
    bell: tuple[int, int] | None,
) -> Callable[[], PendingDigests]:
    """The Triton path: source and target (page ids, first int32 column) in one launch,
    and the doorbell after it.

    Host page ids on CUDA go through `WRITES`, in bucketed shapes (`_Bucket`): a write
    whose bucket came back is replayed from a CUDA graph holding the ids' upload, the
    launch, the sums, their copy to pinned host memory and the ring, so its host work
    is a copy of the ids and one graph launch; the graph is captured when the write is
    armed, never when it launches."""
    pages, dst_pages = page_lists
    device = views[0].device
    segments = list(segments)
    words = [count * page_size * num_cols for _, count in segments]
    count = len(segments) * len(views)  # the sums the write's digests come from
    ring = np.asarray([*bell, count] if bell is not None else [], dtype=np.int64)
    if not isinstance(pages, np.ndarray):  # ids already on the device: as they are
        rings = None if bell is None else (_uploaded(ring, device), 0)
        launch = _Launch(views, checked, page_size, col_starts, num_cols, segments)
        return lambda: launch.run((None, pages, dst_pages), rings, words)
    assert isinstance(dst_pages, np.ndarray)  # both host ids, or both device ones
    bucket = _Bucket.of(segments, len(pages), len(views))
    joined, parts = _joined(
        [bucket.table(segments, page_size), bucket.padded(pages), bucket.padded(dst_pages), ring]
    )
    launch = _Launch(views, checked, page_size, col_starts, num_cols, bucket.segments)

    def eager(ids: np.ndarray | torch.Tensor) -> PendingDigests:
        on_device = _uploaded(ids, device)  # host tables go up; a graph's device ids stay
        described, src, dst = (on_device[start:end] for start, end in parts[:3])
        rings = None if bell is None else (on_device, parts[3][0])
        return launch.run((described, src, dst), rings, words)

    if not _capturable(device):
        return lambda: eager(joined)
    key = (page_size, bucket.key, col_starts, num_cols, bell is not None)
    replay = WRITES.arm(
        key,
        (views, checked.views),
        device,
        functools.partial(_written, joined),
        eager,
        joined,
        ahead=bucket.sums,
    )

    def launched() -> PendingDigests:
        pending = replay()
        pending.words = words  # this write's segments (a replay's value is its shape's)
        return pending

    return launched


def _written(ids: np.ndarray, into: torch.Tensor | None) -> torch.Tensor:
    """A write's joined tables (checked when they were built), copied to a slot's ids."""
    if into is None:
        return torch.from_numpy(ids)
    into.numpy()[:] = ids
    return into


@dataclass(frozen=True)
class _Bucket:
    """A write's shape as a graph is captured for it: its segment count and its page
    count rounded up to powers of two (pages past the write's own are never read:
    the kernel stops at each segment's tokens; segments past its own have none), so
    one graph serves every prompt length of the bucket."""

    num_segments: int
    segment_pages: int  # the longest segment's pages (the grid's token blocks)
    num_pages: int
    num_buffers: int

    @staticmethod
    def of(segments: list[tuple[int, int]], num_pages: int, num_buffers: int) -> _Bucket:
        longest = max(count for _, count in segments)
        pages = _power_of_two(num_pages)
        if len(segments) == 1:  # one segment: as long as the bucket's pages
            longest = pages
        return _Bucket(_power_of_two(len(segments)), longest, pages, num_buffers)

    @property
    def key(self) -> tuple[int, int, int]:
        return self.num_segments, self.segment_pages, self.num_pages

    @property
    def segments(self) -> list[tuple[int, int]]:
        """What the launch is sized by: as many segments, each as long as the longest."""
        return [(0, self.segment_pages)] * self.num_segments

    @property
    def sums(self) -> int:
        return self.num_segments * self.num_buffers

    def table(self, segments: list[tuple[int, int]], page_size: int) -> np.ndarray:
        from pdctl.staging.kernels.digests import segment_table

        padded = [*segments, *[(0, 0)] * (self.num_segments - len(segments))]
        return segment_table(padded, page_size)

    def padded(self, ids: np.ndarray) -> np.ndarray:
        out = np.zeros(self.num_pages, dtype=np.int64)
        out[: len(ids)] = ids
        return out


def _power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


class _Launch:
    """The launch of one write's tables: the page-digest kernel with its store on,
    sized by `segments` (a bucket's, or the write's own), then the ring."""

    def __init__(
        self,
        views: list[torch.Tensor],
        checked: _Checked,
        page_size: int,
        col_starts: tuple[int, int],
        num_cols: int,
        segments: list[tuple[int, int]],
    ) -> None:
        self.views, self.checked, self.page_size = views, checked, page_size
        self.col_starts, self.num_cols, self.segments = col_starts, num_cols, segments

    def run(
        self, tables: tuple[torch.Tensor | None, Any, Any], rings: Any, words: list[int]
    ) -> PendingDigests:
        from pdctl.staging.kernels.bell import ring_from_device
        from pdctl.staging.kernels.digests import PageRows, launch_page_digest_sums

        described, src, dst = tables
        views, checked = self.views, self.checked
        source = PageRows(
            DIGEST_TABLES.get(views),
            src,
            views[0].shape[1],
            self.col_starts[0],
            ALIGNED.get(views),
        )
        target = PageRows(
            checked.table, dst, checked.views[0].shape[1], self.col_starts[1], checked.aligned
        )
        sums = launch_page_digest_sums(
            source,
            self.segments,
            num_buffers=len(views),
            page_size=self.page_size,
            num_cols=self.num_cols,
            target=target,
            described=described,
        )
        if rings is not None:
            ring_from_device(rings[0], rings[1], sums, SUMS)
        return PendingDigests(sums, words, len(views), rung=rings is not None)


WRITES: CapturedCalls[PendingDigests] = CapturedCalls(capture=capture_writes)


def _capturable(device: torch.device) -> bool:
    return WRITES.enabled and device.type == "cuda"


def _joined(parts: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The int64 arrays end to end, each from an even offset (16 bytes, the alignment
    Triton compiles pointers for), and each one's [start, end)."""
    sizes = [len(part) + len(part) % 2 for part in parts]
    joined = np.zeros(sum(sizes), dtype=np.int64)
    spans, offset = [], 0
    for part, size in zip(parts, sizes, strict=True):
        joined[offset : offset + len(part)] = part
        spans.append((offset, offset + len(part)))
        offset += size
    return joined, spans


def _uploaded(ids: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Ids on `device` (host ones copied there; ids already there as they are)."""
    tensor = torch.from_numpy(ids) if isinstance(ids, np.ndarray) else ids
    return tensor.to(device, non_blocking=True)


def _page_ids(pages: PageIndices, num_pages: int) -> np.ndarray | torch.Tensor:
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


def write_pages_reference(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    page_indices: PageIndices,
    target: PeerPages,
    *,
    head_start: int,
    num_heads: int,
    page_size: int,
) -> None:
    """The write alone, in torch: every buffer's slice rows copied page for page."""
    sources = [b for pair in zip(k_buffers, v_buffers, strict=True) for b in pair]
    device = sources[0].device
    src = torch.as_tensor(page_indices).to(device=device, dtype=torch.int64)
    dst = torch.as_tensor(target.pages).to(device=device, dtype=torch.int64)
    offsets = torch.arange(page_size, device=device)
    src_rows = (src[:, None] * page_size + offsets).reshape(-1)
    dst_rows = (dst[:, None] * page_size + offsets).reshape(-1)
    low, high = target.head_start, target.head_start + num_heads
    for source, buffer in zip(sources, target.buffers, strict=True):
        words, into = _bytes(source), _bytes(buffer)  # bit patterns, never values
        into[dst_rows, low:high] = words.index_select(0, src_rows)[
            :, head_start : head_start + num_heads
        ]


def _bytes(buffer: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] -> the same memory as [tokens, heads, head_bytes] uint8."""
    return buffer.view(torch.uint8).view(buffer.shape[0], buffer.shape[1], -1)
