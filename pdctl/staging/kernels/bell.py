"""A doorbell rung by the device, at the end of the launch sequence that wrote the bytes.

`ring_from_device` enqueues one program on the current stream that copies `values`
(int64 on the device: the write's digest sums) into a receiver's bell slot, then its
check word, then the slot's sequence number (`doorbell`'s layout). The slot's device
address, the sequence number and how many values it carries are read from device
memory (`ids[at]`, `ids[at+1]`, `ids[at+2]`), uploaded with the write's page ids, so
a CUDA graph that captured the launch rings a new slot with a new number, and as many
values as that write has, on every replay. The receiver's check word covers the
order in which the stores become visible to its host.

What this does not know: whose box it is, or what the values mean.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdctl.staging import device as dev
from pdctl.staging.doorbell import (
    CHECK,
    CHECK_COUNT,
    CHECK_KIND,
    CHECK_SEQ,
    COUNT,
    KIND,
    SEQ,
    SLOT_HEADER,
)
from pdctl.staging.kernels.launch import DirectLauncher

MAX_VALUES = 1 << 16  # a bell slot's values at most (one program walks them)
BLOCK = 256  # values a step: one compiled kernel whatever a write's count


@triton.jit(do_not_specialize=["at", "most", "kind"])
def _ring_kernel(  # type: ignore[no-untyped-def]
    ids_ptr,
    values_ptr,
    at,
    most,
    kind,
    BLOCK: tl.constexpr,
    HEADER: tl.constexpr,
    SEQ_AT: tl.constexpr,
    CHECK_AT: tl.constexpr,
    COUNT_AT: tl.constexpr,
    KIND_AT: tl.constexpr,
    C_SEQ: tl.constexpr,
    C_COUNT: tl.constexpr,
    C_KIND: tl.constexpr,
):
    slot = tl.load(ids_ptr + at).to(tl.pointer_type(tl.int64))
    seq = tl.load(ids_ptr + at + 1)
    count = tl.minimum(tl.load(ids_ptr + at + 2), most)  # never past `values`
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, count, BLOCK):  # one compiled kernel for any count
        index = start + tl.arange(0, BLOCK)
        mask = index < count
        values = tl.load(values_ptr + index, mask=mask, other=0)
        tl.store(slot + HEADER + index, values, mask=mask)
        total += values * (index.to(tl.int64) * 2 + 3)  # wraps modulo 2**64, as numpy's uint64
    check = tl.sum(total, axis=0)
    count64 = count.to(tl.int64)
    kind64 = kind.to(tl.int64)
    check += seq * C_SEQ + count64 * C_COUNT + kind64 * C_KIND
    tl.store(slot + COUNT_AT, count64)
    tl.store(slot + KIND_AT, kind64)
    tl.store(slot + CHECK_AT, check)
    tl.store(slot + SEQ_AT, seq)  # last: the receiver reads the slot once it sees it


_CONSTEXPRS = {  # the kernel's: a step's values, then the bell slot's layout (`doorbell`)
    "BLOCK": BLOCK,
    "HEADER": SLOT_HEADER,
    "SEQ_AT": SEQ,
    "CHECK_AT": CHECK,
    "COUNT_AT": COUNT,
    "KIND_AT": KIND,
    "C_SEQ": CHECK_SEQ,
    "C_COUNT": CHECK_COUNT,
    "C_KIND": CHECK_KIND,
}
_RING = DirectLauncher(_ring_kernel, tuple(_CONSTEXPRS))
_LAYOUT = tuple(_CONSTEXPRS.values())


def ring_from_device(ids: torch.Tensor, at: int, values: torch.Tensor, kind: int) -> None:
    """Ring the slot whose device address is `ids[at]` with sequence number `ids[at+1]`
    and the first `ids[at+2]` of `values` ([n] int64, n <= MAX_VALUES; no more than n
    are read), enqueued on the current stream."""
    count = values.numel()
    if values.dtype != torch.int64 or ids.dtype != torch.int64 or not 0 < count <= MAX_VALUES:
        raise ValueError(f"a device ring takes 1 to {MAX_VALUES} int64 values and int64 ids")
    if ids.numel() < at + 3:
        raise ValueError(f"the ids hold no ring at {at} (address, number, count)")
    with dev.device_context(values.device):  # Triton launches on the thread's current device
        _RING((1, 1, 1), (ids, values.contiguous()), (at, count, kind), _LAYOUT, 4)
