"""Page ids into device memory by a kernel that reads them from pinned host memory.

A captured staging call (`captured.CudaSlot`) starts by bringing its ids from the
slot's pinned array to the device. As a copy node that is a copy-engine transfer
between two kernels, and on an H200 each such hand-over between engines costs
microseconds on both sides: a graph of upload copy plus kernel took 72.7 us where the
kernel alone takes 61.0 us (28 x 2 x 128, 8192 page ids, 64 KiB). Read by a kernel
(the host array is mapped into the device's address space, as pinned memory is under
unified addressing) the upload stays on the compute engine: 65.2 us for both
(`benchmarks/staging_e2e_profile.py`). Each id is read over the bus once, here, and
the staging kernel then reads the device copy (a staging kernel reading the pinned
ids itself would fetch each one once per buffer).

Used inside the graph where the ids cannot be copied ahead of it (the upload ahead,
`StagingSettings.upload_ahead`, is the default); there it is the default
(`StagingSettings.upload_kernel`; off, a copy node).
Its compile run before a capture must go on the caller's stream (`captured._uploader`):
on a side stream it wrote a slot's fresh device ids under the eager call still running,
and 2 of 9 `pdctl bench staging` runs on an H200 faulted with an illegal memory access;
on the caller's stream 0 of 20, and compute-sanitizer's memcheck of
`benchmarks/staging_e2e_profile.py --stress` is clean.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # ids per program


@triton.jit
def _upload_kernel(source_ptr, target_ptr, count, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    tl.store(target_ptr + offsets, tl.load(source_ptr + offsets, mask=mask), mask=mask)


def upload(pinned: torch.Tensor, target: torch.Tensor) -> None:
    """`target.copy_(pinned)` by a kernel on the current stream (`pinned`: page-locked
    host memory; `target`: device memory of the same dtype and length)."""
    if pinned.numel() != target.numel() or pinned.dtype != target.dtype:
        raise ValueError(
            f"upload of {pinned.numel()} {pinned.dtype} ids into {target.numel()} {target.dtype}"
        )
    if not pinned.is_pinned():
        raise ValueError("the upload kernel reads page-locked (pinned) host memory only")
    if pinned.numel():
        _upload_kernel[(triton.cdiv(pinned.numel(), BLOCK),)](
            pinned, target, pinned.numel(), BLOCK=BLOCK
        )
