"""The digest sums in one Triton launch: one read of the bytes, no int64 temporaries.

`digest.chunk_digests` defines the value: per chunk, the sum of its words x_i times
(2 i + 1), modulo 2**64. The torch path materialises the words as int64, the
weights and their products (about eleven bytes of traffic per byte digested, and a
host round trip per eight chunks); here program (c, b) loads block b of chunk c
once, widens each word as torch does (signed for int16/int32, unsigned for bytes),
multiplies and sums in int64 (wrapping, as torch's int64 arithmetic does), and
writes one partial sum; the partials are summed by torch. Integer sums modulo 2**64
do not depend on their order, so the values are bit-identical to the torch path
(tests/staging/test_digest_kernel.py, interpreted on the CPU in CI).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from pdctl.staging import device as dev

BLOCK = 4096  # words per program


@triton.jit(do_not_specialize=["chunk_words", "blocks"])
def _digest_kernel(words_ptr, partial_ptr, chunk_words, blocks, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    chunk = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    index = block * BLOCK + tl.arange(0, BLOCK)
    mask = index < chunk_words
    x = tl.load(words_ptr + chunk * chunk_words + index, mask=mask, other=0)
    weighted = x.to(tl.int64) * (index * 2 + 1)
    tl.store(partial_ptr + chunk * blocks + block, tl.sum(weighted, axis=0))


def digest_sums(words: torch.Tensor) -> list[int]:
    """[n_chunks, n_words] integer words -> each chunk's weighted sum as an int64 value."""
    num_chunks, chunk_words = words.shape
    blocks = triton.cdiv(chunk_words, BLOCK)
    partial = torch.empty(num_chunks, blocks, dtype=torch.int64, device=words.device)
    device = words.device
    context = dev.device_context(device) if device.type != "cpu" else contextlib.nullcontext()
    with context:  # Triton launches on the thread's current device
        _digest_kernel[(num_chunks, blocks)](
            words, partial, chunk_words, blocks, BLOCK=BLOCK, num_warps=8
        )
    sums: list[int] = partial.sum(dim=1).tolist()
    return sums
