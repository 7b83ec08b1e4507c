"""The CPU's paged attention in C (`native_attention.c`): one query row at a time, over
its own keys only, in one fixed order; the torch path stays where it cannot serve.

The torch path (`attention.paged_attention_reference`) pads every query to a tile of
16 rows and every key run to blocks of 64, in tens of small tensor operations a layer;
a CPU decode step spent most of its time there (docs/benchmarks.md). The C
kernel's numbers for a row depend only on that row's query and keys, so serving stays
batch-, chunk- and prefix-invariant; they equal the torch path's to rounding, not
bitwise, so a process uses one of the two for every forward: float32 KV on the CPU
with the library built takes the C kernel, anything else the torch path (`serves`).
It is built once per source version with the host's compiler, beside the staging copy
(`staging.kernels.native.build`); the server's `--no-native-attention` turns it off
(`switch_off`, once at start), and `available()` says why it is not there when it is not.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from pdctl.serve.model.batch import KeyTable
from pdctl.staging.kernels import native

SOURCE = Path(__file__).with_name("native_attention.c")
_off: list[bool] = []  # the server's setting, applied once at start (`switch_off`)
# No fused multiply-adds of the compiler's choosing: the same numbers from every compiler.
FLAGS = ("-ffp-contract=off",)


def switch_off() -> None:
    """`--no-native-attention`: every forward of this process takes the torch path."""
    _off.append(True)
    _kernel.cache_clear()


@functools.cache
def _kernel() -> tuple[Any, str]:  # (the C function or None, why)
    if _off:
        return None, "turned off (--no-native-attention)"
    try:
        library = ctypes.CDLL(str(native.build(SOURCE, "attention", FLAGS)))
    except OSError as exc:
        return None, str(exc)
    function = library.pdctl_paged_attention_f32
    function.argtypes = (  # as the call in paged_attention groups them
        [ctypes.c_void_p] * 4
        + [ctypes.c_int64] * 2
        + [ctypes.c_void_p] * 4
        + [ctypes.c_int64] * 5
        + [ctypes.c_float]
        + [ctypes.c_int64] * 2
        + [ctypes.c_int]
    )
    function.restype = ctypes.c_int
    return function, "built"


def available() -> tuple[bool, str]:
    """(whether the C kernel can serve CPU attention, and why not when it cannot)."""
    function, why = _kernel()
    return function is not None, why


def serves(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether this call goes to the C kernel: float32 on the CPU, the library built."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_buffer.dtype == torch.float32
        and _kernel()[0] is not None
    )


def _checked_table(keys: KeyTable, pool_rows: int) -> tuple[int, int]:
    """(queries, the longest piece's keys) once the table's indices were checked against
    the pool: the C code trusts them. Checked once a forward (kept in `keys.derived`)."""
    found = keys.derived.get(("native", pool_rows))
    if found is not None:
        return found  # type: ignore[return-value]
    lengths, starts = keys.lengths.tolist(), keys.starts.tolist()
    key_offsets, query_offsets = keys.key_offsets.tolist(), keys.query_offsets.tolist()
    queries = 0
    for length, start, key_offset, query_offset in zip(
        lengths, starts, key_offsets, query_offsets, strict=True
    ):
        if not 0 <= start < length or key_offset + length > keys.rows.numel():
            raise ValueError(f"a key table's piece at {start} of {length} keys is inconsistent")
        if query_offset != queries:
            raise ValueError("a key table's pieces do not follow each other in q")
        queries += length - start
    rows = keys.rows
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= pool_rows):
        raise ValueError(f"a key table names a row outside the pool's {pool_rows}")
    found = (queries, max(lengths, default=0))
    keys.derived[("native", pool_rows)] = found
    return found


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    keys: KeyTable,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """`attention.paged_attention` in C (same signature; `serves` said yes): q [rows, Hq,
    D] -> [rows, Hq, D], rows past the batch's queries zeros."""
    function, why = _kernel()
    if function is None:
        raise RuntimeError(f"the C attention is not available: {why}")
    rows, heads, dim = q.shape
    pool_rows, kv_heads, kv_dim = k_buffer.shape
    if v_buffer.shape != k_buffer.shape or kv_dim != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit K/V {tuple(k_buffer.shape)}")
    for buffer in (k_buffer, v_buffer):
        if not buffer.is_contiguous() or buffer.dtype != torch.float32:
            raise ValueError("K and V buffers must be contiguous float32 [pool, Hkv, D]")
    queries, max_keys = _checked_table(keys, pool_rows)
    if queries > rows:
        raise ValueError(f"{queries} queries in the key table, q has {rows} rows")
    q = q.contiguous()
    out = torch.zeros_like(q)
    tables = [t.contiguous() for t in keys.tensors[:4]]  # rows, key/query offsets, starts
    operands = [t.data_ptr() for t in (q, k_buffer, v_buffer, out)]
    table_pointers = [t.data_ptr() for t in tables]
    strides = (heads * dim, kv_heads * dim)  # a row of q (and out), of K and V
    shape = (keys.lengths.numel(), queries, heads, kv_heads, dim)
    threads = torch.get_num_threads()
    status = function(
        *operands, *strides, *table_pointers, *shape, scale, window or 0, max_keys, threads
    )
    if status != 0:
        raise MemoryError("the C attention could not allocate its scratch memory")
    return out
