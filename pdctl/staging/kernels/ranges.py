"""Many byte ranges copied in one launch: the device half of a scattered write.

A direct KV write carries one descriptor per page and layer (1024 of 4 KiB for a
modest prompt); one device copy per descriptor costs about 15 us of host work
each, so a 4 MiB write took 15 ms where the device needs 2 us. Here the whole
list goes to the device as three tables (source address, destination address,
length), and one kernel copies them: program (i, j) copies chunk j of range i.
Addresses are this process's (a peer's memory mapped through the device's IPC
is this process's memory); the caller proves every range lies in memory it may
touch. Copies are bit-exact, in words of the widest width every address and
length allows (8, 4, 2 or 1 bytes).

    python: copy_ranges(device, src, dst, lengths)   # np.uint64 arrays, enqueued
                                                    # on the current stream
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from pdctl.staging import device as dev
from pdctl.staging.kernels.kvset import WORD_DTYPES
from pdctl.staging.kernels.launch import DirectLauncher

CHUNK_BYTES = 16 * 1024  # bytes per program at most
MAX_CHUNKS = 65535  # the grid's second dimension
MAX_RANGE_BYTES = MAX_CHUNKS * CHUNK_BYTES  # longer ranges are copied on their own


@triton.jit(do_not_specialize=["num_ranges"])
def _copy_ranges_kernel(table_ptr, word_ptr, num_ranges, CHUNK: tl.constexpr):  # type: ignore[no-untyped-def]
    index = tl.program_id(0)
    chunk = tl.program_id(1)
    word = tl.pointer_type(word_ptr.dtype.element_ty)
    source = tl.load(table_ptr + index).to(word)
    target = tl.load(table_ptr + num_ranges + index).to(word)
    length = tl.load(table_ptr + 2 * num_ranges + index)  # in words
    offsets = tl.max_contiguous(chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK), CHUNK)
    mask = offsets < length
    values = tl.load(source + offsets, mask=mask, eviction_policy="evict_first")
    tl.store(target + offsets, values, mask=mask, cache_modifier=".cs")


_LAUNCH = DirectLauncher(_copy_ranges_kernel, ("CHUNK",))


def word_bytes(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> int:
    """The widest word (8, 4, 2, 1 bytes) every address and length is a multiple of."""
    bits = int(np.bitwise_or.reduce(src | dst | lengths))
    for word in (8, 4, 2):
        if bits % word == 0:
            return word
    return 1


@functools.lru_cache(maxsize=64)
def _dummy(device: torch.device, word: int) -> torch.Tensor:
    return torch.empty(1, dtype=WORD_DTYPES[word], device=device)  # carries the word type


def copy_ranges(
    device: torch.device, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
) -> None:
    """Enqueue dst[i] <- src[i] (lengths[i] bytes) for every i on the current stream.

    The host table is copied to the device before this returns, so the arrays may
    change at once; the ranges' bytes are read when the kernel runs.
    """
    if len(src) == 0:
        return
    word = word_bytes(src, dst, lengths)
    words = lengths // np.uint64(word)
    longest = int(words.max())
    chunk = max(16, min(triton.next_power_of_2(longest), CHUNK_BYTES // word))
    table = np.concatenate([src, dst, words]).view(np.int64)
    grid = (len(src), triton.cdiv(longest, chunk))
    if grid[1] > MAX_CHUNKS:
        raise ValueError(
            f"a range of {longest * word} bytes is too long for one launch "
            f"(at most {MAX_CHUNKS * chunk * word}); copy it on its own"
        )
    on_device = torch.from_numpy(table).to(device)  # pageable: copied before returning
    warps = 8 if chunk * word >= 8192 else 4
    with dev.device_context(device):  # Triton launches on the thread's current device
        _LAUNCH((*grid, 1), (on_device, _dummy(device, word)), (len(src),), (chunk,), warps)
