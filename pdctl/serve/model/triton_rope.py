"""RoPE of q and k plus the KV-pool write, in one launch for accelerators (Triton).

Why: the torch path is seven launches for q, seven for k (slices, four products, a
sum, a difference, a concatenation) and a cast and an index_put each for K and V, per
layer. One program handles one head of one token of the fused qkv product:

    qkv [T, q_heads * D | kv_heads * D | kv_heads * D]  (row stride >= that; the q, k and
         q heads         k heads         v heads         v blocks start at 0, Hq*D, (Hq+Hkv)*D)

    head h < q_heads:  q_out[t, h]           = rotate(q part of row t, head h)
    otherwise (k = h - q_heads), for t < new_rows.numel():
                       k_buffer[new_rows[t], k] = rotate(k part of row t, head k)
                       v_buffer[new_rows[t], k] = v part of row t, head k

    rotate(x) = (x1 * cos - x2 * sin, x2 * cos + x1 * sin), x1, x2 the halves of x
    (Llama's half-split layout), in float32 with the per-token tables [T, D/2].

Each output element depends on its own row's numbers alone, so it is batch-invariant.
q comes back in the KV cache's dtype (attention multiplies in it). The torch reference
with the same signature is `ops.rope_and_cache_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_new"])  # one compiled kernel for any batch
def _rope_and_cache_kernel(  # type: ignore[no-untyped-def]
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    new_rows_ptr,
    num_new,
    qkv_row,
    table_row,
    q_token,
    q_head,
    k_token,
    k_head,
    v_token,
    v_head,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK)
    ok = dims < HALF
    cos = tl.load(cos_ptr + token * table_row + dims, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * table_row + dims, mask=ok, other=0.0).to(tl.float32)
    row = qkv_ptr + token * qkv_row
    if head < Q_HEADS:
        src = row + head * 2 * HALF
        dst = q_ptr + token * q_token + head * q_head
        store_ok = ok
    else:
        kv = head - Q_HEADS
        src = row + (Q_HEADS + kv) * 2 * HALF
        pool_row = tl.load(new_rows_ptr + token, mask=token < num_new, other=0)
        dst = k_ptr + pool_row * k_token + kv * k_head
        store_ok = ok & (dims * 0 + token < num_new)  # a vector mask (the interpreter's too)
        v_src = row + (Q_HEADS + KV_HEADS + kv) * 2 * HALF
        v_dst = v_ptr + pool_row * v_token + kv * v_head
        for part in tl.static_range(2):  # V is copied as is, one half at a time
            v = tl.load(v_src + part * HALF + dims, mask=ok, other=0.0)
            tl.store(v_dst + part * HALF + dims, v.to(v_ptr.dtype.element_ty), mask=store_ok)
    first = tl.load(src + dims, mask=ok, other=0.0).to(tl.float32)
    second = tl.load(src + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    out_type = k_ptr.dtype.element_ty  # q is allocated in the cache's dtype
    tl.store(dst + dims, (first * cos - second * sin).to(out_type), mask=store_ok)
    tl.store(dst + HALF + dims, (second * cos + first * sin).to(out_type), mask=store_ok)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    new_rows: torch.Tensor,
) -> torch.Tensor:
    """Rotated q [T, q_heads, D] in the cache's dtype; K and V of rows < len(new_rows) stored.

    Checked; reads only shapes on the host.
    """
    _check(qkv, cos, sin, q_heads, k_buffer, v_buffer, new_rows)
    tokens, (kv_heads, dim) = qkv.shape[0], k_buffer.shape[1:]
    q = torch.empty((tokens, q_heads, dim), dtype=k_buffer.dtype, device=qkv.device)
    if tokens:
        operands = (qkv, cos, sin, q, k_buffer, v_buffer, new_rows)
        rows = (qkv.stride(0), cos.stride(0))  # a token's row of qkv, of the tables
        strides = [s for t in (q, k_buffer, v_buffer) for s in t.stride()[:2]]  # token, head
        half = dim // 2
        meta = {"Q_HEADS": q_heads, "KV_HEADS": kv_heads, "HALF": half, "num_warps": 1}
        meta["BLOCK"] = triton.next_power_of_2(half)
        _rope_and_cache_kernel[(tokens, q_heads + kv_heads)](
            *operands, new_rows.shape[0], *rows, *strides, **meta
        )
    return q


def _check(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    new_rows: torch.Tensor,
) -> None:
    if k_buffer.dim() != 3 or k_buffer.shape != v_buffer.shape or k_buffer.shape[2] % 2:
        raise ValueError(
            f"need K, V [pool, kv heads, even dim] of one shape, got "
            f"{tuple(k_buffer.shape)}, {tuple(v_buffer.shape)}"
        )
    kv_heads, dim = k_buffer.shape[1], k_buffer.shape[2]
    width = (q_heads + 2 * kv_heads) * dim
    if qkv.dim() != 2 or qkv.shape[1] < width or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {width} contiguous columns")
    for table in (cos, sin):
        if table.shape[0] < qkv.shape[0] or table.shape[1] != dim // 2 or table.stride(1) != 1:
            raise ValueError(f"a table is {tuple(table.shape)}, need [>= T, {dim // 2}]")
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin need one row stride")
    if new_rows.dim() != 1 or new_rows.shape[0] > qkv.shape[0] or new_rows.dtype != torch.int64:
        raise ValueError(f"new_rows must be int64 [<= {qkv.shape[0]}], got {new_rows.shape}")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("K and V need a contiguous head dimension")
    for tensor in (cos, sin, k_buffer, v_buffer, new_rows):
        if tensor.device != qkv.device:
            raise ValueError(f"qkv is on {qkv.device}, an operand on {tensor.device}")
