"""RMSNorm in one launch for accelerators (Triton), used by `ops.rms_norm`.

Why: the torch path on an accelerator is six or more launches (square, a fixed-order
row sum, divide, add, rsqrt, two products) per norm, twice a layer; a decode step is
bound by launches, not by bytes. One program normalises one row:

    sum_sq = sum over x[r, 0..H-1] ** 2   (float32: BLOCK-wide partial sums over the
                                           row's blocks in order, then one tl.sum)
    out[r] = x[r] * rsqrt(sum_sq / H + eps) * weight      (float32, rounded once)

The instruction sequence depends only on H and BLOCK (set by H alone), never on the
number of rows or a row's position, so a row's output is bitwise the same alone or in
any batch. The output takes the dtype the next product wants, so no cast follows.
The torch reference with the same signature is `ops.rms_norm_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK, NUM_WARPS = 4096, 8


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    x_row,
    out_row,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_at = x_ptr + row * x_row
    partial = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, hidden, BLOCK):  # fixed order: the row's blocks, first to last
        ok = start + cols < hidden
        x = tl.load(x_at + start + cols, mask=ok, other=0.0).to(tl.float32)
        partial += x * x
    scale = 1.0 / tl.sqrt(tl.sum(partial, axis=0) / hidden + eps)
    for start in range(0, hidden, BLOCK):
        ok = start + cols < hidden
        x = tl.load(x_at + start + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
        out = x * scale * w
        tl.store(out_ptr + row * out_row + start + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [..., H] normalised per row, times weight [H]; in out_dtype (default x's). Checked."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device}, the weight on {weight.device}")
    rows = x.reshape(-1, hidden)  # a view for the runner's contiguous rows
    if rows.stride(-1) != 1 or weight.stride(0) != 1:
        rows, weight = rows.contiguous(), weight.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype or x.dtype, device=x.device)  # [rows, H]
    if rows.shape[0] and hidden:
        block = min(MAX_BLOCK, triton.next_power_of_2(hidden))
        strides = (rows.stride(0), out.stride(0))
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, hidden, *strides, eps, BLOCK=block, num_warps=NUM_WARPS
        )
    return out.view(x.shape)
