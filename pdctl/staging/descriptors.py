"""Transfer descriptors and device pointers as unsigned 64-bit values.

Device pointers can set bit 63 (XPU kernel-space addresses), which a signed int64
reads as negative and `torch.tensor(..., dtype=torch.int64)` rejects. Every
descriptor here is a `np.uint64` array, and pointer tables for kernels are built
through a uint64 -> int64 bit cast, never through a signed conversion.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

U64_MASK = (1 << 64) - 1


def unsigned_ptr(pointer: int) -> int:
    """A pointer as an unsigned 64-bit Python int, whatever sign it came with."""
    return pointer & U64_MASK


def tensor_ptr(tensor: torch.Tensor) -> int:
    return unsigned_ptr(tensor.data_ptr())


def as_u64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Python ints (any sign, < 2**64) -> np.uint64 without truncation."""
    if isinstance(values, np.ndarray):
        if values.dtype == np.uint64:
            return values
        if values.dtype.kind == "i":
            return values.astype(np.int64).view(np.uint64)
        raise TypeError(f"pointers must be integers, got dtype {values.dtype}")
    return np.array([unsigned_ptr(int(v)) for v in values], dtype=np.uint64)


def pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Kernel pointer table: data pointers as int64 bit patterns, on `device`."""
    bits = as_u64([tensor_ptr(t) for t in tensors]).view(np.int64)
    return torch.from_numpy(bits.copy()).to(device)


def region_descriptors(
    src_base: int, dst_base: int, offsets: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_ptrs, dst_ptrs, lengths) for writes of [offset, offset+length) of two buffers."""
    offsets = as_u64(offsets)
    lengths = as_u64(lengths)
    src = np.uint64(unsigned_ptr(src_base)) + offsets
    dst = np.uint64(unsigned_ptr(dst_base)) + offsets
    return src, dst, lengths


def page_descriptors(
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    page_bytes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Direct (no staging) page copies: for every buffer pair and page, one descriptor.

    `src_bases[i]` and `dst_bases[i]` are the base addresses of matching KV buffers
    (layer K, layer V, ...) whose pages are `page_bytes` apart.
    """
    if len(src_bases) != len(dst_bases) or len(src_pages) != len(dst_pages):
        raise ValueError("buffer and page lists must pair up")
    size = np.uint64(page_bytes)
    src_off = as_u64(np.asarray(src_pages, dtype=np.int64)) * size
    dst_off = as_u64(np.asarray(dst_pages, dtype=np.int64)) * size
    src = (as_u64(src_bases)[:, None] + src_off[None, :]).reshape(-1)
    dst = (as_u64(dst_bases)[:, None] + dst_off[None, :]).reshape(-1)
    return src, dst, np.full(src.shape, page_bytes, dtype=np.uint64)


def xpu_pointer_type(pointer: int) -> str:
    """XPU registrations name the address space: bit 63 set means kernel space."""
    return "XPU-kernel-space" if unsigned_ptr(pointer) >> 63 else "XPU-user-space"
