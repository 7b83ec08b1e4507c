"""Digests of staged KV, so decode can prove it scattered what prefill gathered.

One 64-bit digest per chunk (a layer's K or V of one writer block): the chunk's
words x_i weighted by odd constants, summed modulo 2**64, then mixed:

    digest = mix( sum_i x_i * (2 i + 1)  mod 2**64 ,  n )

Integer arithmetic modulo 2**64 is exact and order-independent, so every device
computes the same value for the same bytes. A change to any single word always
changes the sum (an odd weight times a non-zero difference below 2**32 is never a
multiple of 2**64), and moving words changes their weights. It is a check against
corruption and misplacement, not a cryptographic hash. On CUDA and XPU the sums run
as one Triton launch (`kernels/digests.py`, bit-identical to the torch path here).
"""

from __future__ import annotations

import numpy as np
import torch

_MASK = (1 << 64) - 1
_CHUNKS_PER_PASS = 8  # bounds the int64 temporaries to 8 chunks at a time


def _words(chunks: torch.Tensor) -> torch.Tensor:
    """[n_chunks, nbytes] uint8 -> [n_chunks, n_words] as the widest exact int view."""
    nbytes = chunks.shape[1]
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            return chunks.view(dtype)
    return chunks


def _mix(value: int, length: int) -> int:
    """splitmix64 finaliser over the sum and the length."""
    z = (value ^ (length * 0x9E3779B97F4A7C15)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def digest_of_sum(total: int, words: int) -> int:
    """A chunk's digest from its weighted word sum (any int, taken modulo 2**64) and its
    length in words: for sums computed elsewhere (the paged digest kernel)."""
    return _mix(total & _MASK, words)


_GOLDEN, _MIX1, _MIX2 = (
    np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def digests_of_sums(totals: np.ndarray, words: np.ndarray) -> list[int]:
    """`digest_of_sum` over arrays at once (int64 or uint64 sums, word counts): numpy's
    uint64 arithmetic wraps modulo 2**64 as the mix does."""
    with np.errstate(over="ignore"):
        z = totals.astype(np.uint64, copy=False) ^ (words.astype(np.uint64) * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return (z ^ (z >> np.uint64(31))).tolist()


def _backend(device: torch.device, backend: str | None) -> str:
    """triton on CUDA and XPU when it imports (or when asked for), else torch."""
    if backend is not None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"unknown digest backend {backend!r}; known: torch, triton")
        return backend
    from pdctl.staging.kernels.base import default_backend

    return default_backend(device)


def chunk_digests(data: torch.Tensor, num_chunks: int, *, backend: str | None = None) -> list[int]:
    """Digests of `num_chunks` equal consecutive chunks of a uint8 tensor."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("digests are taken over a 1-D uint8 view of the bytes")
    if num_chunks < 1 or data.numel() % num_chunks:
        raise ValueError(f"{data.numel()} bytes do not split into {num_chunks} equal chunks")
    words = _words(data.view(num_chunks, -1))
    length = words.shape[1]
    if _backend(data.device, backend) == "triton":
        from pdctl.staging.kernels.digests import digest_sums

        return [digest_of_sum(value, length) for value in digest_sums(words)]
    weights = torch.arange(length, dtype=torch.int64, device=data.device) * 2 + 1
    sums: list[int] = []
    for start in range(0, num_chunks, _CHUNKS_PER_PASS):
        part = words[start : start + _CHUNKS_PER_PASS].to(torch.int64)
        sums += (part * weights).sum(dim=1).tolist()
    return [digest_of_sum(value, length) for value in sums]


def block_digests(block: torch.Tensor, num_layers: int, *, backend: str | None = None) -> list[int]:
    """Digests of one writer block: [L0.K, L0.V, L1.K, ...] as laid out by `layout`."""
    return chunk_digests(block, 2 * num_layers, backend=backend)


def first_mismatch(sent: list[int], received: list[int]) -> tuple[int, str] | None:
    """(layer, "K" or "V") of the first differing chunk, or None when all agree."""
    if len(sent) != len(received):
        return (0, "K")
    for index, (a, b) in enumerate(zip(sent, received, strict=True)):
        if a != b:
            return index // 2, "KV"[index % 2]
    return None
