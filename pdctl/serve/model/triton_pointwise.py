"""Element-wise fusions for accelerators (Triton): SwiGLU's product, the chunk sums.

Why: a decode step is bound by launches. `silu_mul` is one launch instead of two
(silu, product), rounded once. `add_chunk_sums` replaces a row-parallel product's
chunk reduction (a clone and REDUCTION_CHUNKS - 1 in-place sums) and the residual
sum after it with one launch:

    out[m, n] = residual[m, n] + ((partials[0, m, n] + partials[1, m, n]) + ...)

summed in chunk order in float32 and rounded once, so TP 1, 2, 4 and 8 (which gather
the same chunks in the same order) add the same numbers in the same order. Every
output element depends on its own position's inputs alone: batch-invariant. The
torch references with the same signatures are `ops.silu_mul_reference` and
`ops.add_chunk_sums_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK, NUM_WARPS = 1024, 4
META = {"BLOCK": BLOCK, "num_warps": NUM_WARPS}  # Triton's meta-parameters of both kernels


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    gate_ptr, up_ptr, out_ptr, width, gate_row, up_row, out_row, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_ptr + row * gate_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_chunk_sums_kernel(  # type: ignore[no-untyped-def]
    partials_ptr,
    residual_ptr,
    out_ptr,
    chunks,
    width,
    p_chunk,
    p_row,
    residual_row,
    out_row,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    at = partials_ptr + row * p_row + cols
    total = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    for chunk in range(1, chunks):  # fixed order: chunk 0 first, always
        total += tl.load(at + chunk * p_chunk, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row + cols, mask=ok, other=0.0)
        total = residual.to(tl.float32) + total
    tl.store(out_ptr + row * out_row + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [M, I] operands (any row strides), in gate's dtype. Checked."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.device != up.device:
        raise ValueError(f"need two [M, I] operands, got {tuple(gate.shape)}, {tuple(up.shape)}")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)  # [M, I]
    if rows and width:
        strides = [t.stride(0) for t in (gate, up, out)]  # a row of each
        _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK))](gate, up, out, width, *strides, **META)
    return out


def add_chunk_sums(partials: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """partials [C, M, N] summed in chunk order, plus residual [M, N] if given. Checked."""
    if partials.dim() != 3 or not partials.shape[0]:
        raise ValueError(f"need partials [chunks, M, N], got {tuple(partials.shape)}")
    chunks, rows, width = partials.shape
    if residual is not None and (
        residual.shape != (rows, width) or residual.device != partials.device
    ):
        raise ValueError(f"residual {tuple(residual.shape)} does not match [{rows}, {width}]")
    if partials.stride(2) != 1:
        partials = partials.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty((rows, width), dtype=partials.dtype, device=partials.device)  # [M, N]
    if rows and width:
        with_residual = residual is not None
        added = out if residual is None else residual  # read only with a residual
        strides = (*partials.stride()[:2], added.stride(0) if with_residual else 0, out.stride(0))
        _add_chunk_sums_kernel[(rows, triton.cdiv(width, BLOCK))](
            partials, added, out, chunks, width, *strides, HAS_RESIDUAL=with_residual, **META
        )
    return out
