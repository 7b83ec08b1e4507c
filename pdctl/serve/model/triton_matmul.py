"""A batch-invariant matrix product for accelerators (Triton), used by `ops.py`.

Why: cuBLAS (and other vendor libraries) choose a kernel by shape, and some split
the reduction (split-K) or tile it differently for other M or N, so the same row
times the same weight can round differently with another batch size or TP split.
This kernel has ONE configuration for every shape: each output element is the
sum over K in fixed BLOCK_K steps, in order, accumulated in float32 by the same
instruction sequence, whatever M, N, the batch or the element's position. Rows
never interact, so a row's result depends on that row and the weight alone.

    a [batch, M, K] @ b [batch, K, N] -> c [batch, M, N]   (2-D: batch of one)

Float32 operands take the IEEE path (no TF32), so float32 models keep their
precision. The torch reference is `torch.matmul`, equal up to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Triton's meta-parameters of every product but PRECISION, which the operands' dtype picks
META = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def _matmul_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    a_batch,
    a_m,
    a_k,
    b_batch,
    b_k,
    b_n,
    c_batch,
    c_m,
    c_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_at = a_ptr + batch * a_batch + rows[:, None].to(tl.int64) * a_m + ks[None, :] * a_k
    b_at = b_ptr + batch * b_batch + ks[:, None].to(tl.int64) * b_k + cols[None, :] * b_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # fixed order: the reduction never depends on M or N
        k_mask = (k + ks) < K
        x = tl.load(a_at, mask=(rows[:, None] < M) & k_mask[None, :], other=0.0)
        w = tl.load(b_at, mask=k_mask[:, None] & (cols[None, :] < N), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        a_at += BLOCK_K * a_k
        b_at += BLOCK_K * b_k
    c_at = c_ptr + batch * c_batch + rows[:, None].to(tl.int64) * c_m + cols[None, :] * c_n
    tl.store(c_at, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], or batched [B, M, K] @ [B, K, N]; same dtype, any strides."""
    if a.dim() != b.dim() or a.dim() not in (2, 3):
        raise ValueError(f"need two 2-D or two 3-D operands, got {a.dim()}-D and {b.dim()}-D")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"operands differ: {a.dtype} on {a.device}, {b.dtype} on {b.device}")
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    batch, m, k = a3.shape
    if b3.shape[0] != batch or b3.shape[1] != k:
        raise ValueError(f"shapes do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    n = b3.shape[2]
    c = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if m and n:
        tiles = triton.cdiv(m, META["BLOCK_M"]) * triton.cdiv(n, META["BLOCK_N"])
        strides = (*a3.stride(), *b3.stride(), *c.stride())  # batch, row, column each
        precision = "ieee" if a.dtype == torch.float32 else "tf32"
        _matmul_kernel[(tiles, batch)](a3, b3, c, m, n, k, *strides, **META, PRECISION=precision)
    return c if batched else c[0]
