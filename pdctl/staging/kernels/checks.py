"""Argument checks every checked wrapper shares (gather, scatter, page digests, the
mapped write): head ranges and page segments. What it does not know: the copies."""

from __future__ import annotations

from collections.abc import Sequence

from pdctl.staging.kernels.kvset import KVInfo
from pdctl.staging.layout import KVSlice


def check_heads(kv_slice: KVSlice, info: KVInfo, what: str) -> None:
    """The slice's heads inside the KV set's heads (`what` names the side)."""
    start, end = kv_slice.head_start, kv_slice.head_start + kv_slice.num_heads
    if kv_slice.num_heads < 1 or start < 0 or end > info.num_heads:
        raise ValueError(f"{what} heads [{start}, {end}) are outside the {info.num_heads} KV heads")


def check_segments(segments: Sequence[tuple[int, int]], num_pages: int) -> None:
    """Every (page_start, num_pages) segment inside a list of `num_pages` pages."""
    for start, count in segments:
        if start < 0 or count < 1 or start + count > num_pages:
            raise ValueError(
                f"segment of pages [{start}, {start + count}) is outside the {num_pages} pages"
            )
