"""Causal grouped-query attention over paged KV for a whole batch, in one Triton launch.

One program per (query tile, KV head): the tile's QUERY_BLOCK absolute positions of
one piece, for the GROUP query heads that share the KV head, as GROUP_PAD * QUERY_BLOCK
rows (row g * QUERY_BLOCK + position % QUERY_BLOCK). It walks the piece's keys in
blocks of KEY_BLOCK absolute positions, block 0 first, loading K and V straight from
the pool through the piece's rows, with an online softmax:

    peak' = max(peak, max_j s_j)      alpha = 1 if peak' == peak else exp(peak - peak')
    norm  = norm * alpha + sum_j p_j   acc = acc * alpha + p @ V    p_j = exp(s_j - peak')

A block a query may not see changes nothing for it (alpha = 1, p = 0: norm + 0,
acc * 1 + 0), so the tile's extent (the furthest query in it) never reaches a query's
numbers, and the operations applied to a query's row depend only on its absolute
position and its keys: not on the batch, the chunking, a prefix-cache hit or the
other rows of its tile. One configuration for every batch: tile sizes are constants
and the rest depends only on the model (head dim, group, sliding window).

A sliding window (WINDOW > 0) hides key j from the query at position i unless
i - WINDOW < j <= i. The walk then starts at the block holding the tile's first
visible key, max(0, first - WINDOW + 1) rounded down to KEY_BLOCK: every block before
it is hidden from every row of the tile, so skipping it changes nothing (see above),
and the blocks walked keep their fixed order.

Both products take their inputs in the KV cache's dtype (q and the weights p are
rounded to it; bf16 on GPUs, so they run on tensor cores) and accumulate in float32;
a float32 cache multiplies in IEEE float32. Measured on an H200 with float32
products on the CUDA cores, a decode step of the small preset spent 28 ms here.

The torch reference with the same signature is `attention.paged_attention_reference`
(the same fixed blocks, a global maximum instead of the online one: equal to rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdctl.serve.model.batch import KEY_BLOCK, QUERY_BLOCK, KeyTable

NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    rows_ptr,
    key_offsets_ptr,
    query_offsets_ptr,
    starts_ptr,
    lengths_ptr,
    tile_pieces_ptr,
    tile_positions_ptr,
    scale,
    q_token,
    q_head,
    k_token,
    k_head,
    v_token,
    v_head,
    out_token,
    out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUERY_BLOCK: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    piece = tl.load(tile_pieces_ptr + tile)
    first = tl.load(tile_positions_ptr + tile)
    start = tl.load(starts_ptr + piece)
    length = tl.load(lengths_ptr + piece)
    key_offset = tl.load(key_offsets_ptr + piece)
    rows = tl.arange(0, GROUP_PAD * QUERY_BLOCK)
    group = rows // QUERY_BLOCK
    positions = first + rows % QUERY_BLOCK
    real = (group < GROUP) & (positions >= start) & (positions < length)
    heads = kv_head * GROUP + group
    tokens = tl.load(query_offsets_ptr + piece) + positions - start
    dims = tl.arange(0, BLOCK_D)
    dims_ok = dims < HEAD_DIM
    q_at = q_ptr + tokens[:, None] * q_token + heads[:, None] * q_head + dims[None, :]
    dot_type = k_ptr.dtype.element_ty  # products in the cache's dtype, sums in float32
    q = tl.load(q_at, mask=real[:, None] & dims_ok[None, :], other=0.0).to(dot_type)
    peak = tl.full((GROUP_PAD * QUERY_BLOCK,), float("-inf"), tl.float32)
    norm = tl.zeros((GROUP_PAD * QUERY_BLOCK,), tl.float32)
    acc = tl.zeros((GROUP_PAD * QUERY_BLOCK, BLOCK_D), tl.float32)
    end = tl.minimum(first + QUERY_BLOCK, length)  # the tile sees keys 0..end-1
    lo = first * 0  # block 0 (a tensor, like the windowed start)
    if WINDOW > 0:  # blocks before the tile's first visible key add nothing: skipped
        lo = tl.maximum(first - WINDOW + 1, 0) // KEY_BLOCK * KEY_BLOCK
    for block in range(lo, end, KEY_BLOCK):  # fixed order: the first visible block first
        keys = block + tl.arange(0, KEY_BLOCK)
        keys_ok = keys < length
        pool_rows = tl.load(rows_ptr + key_offset + keys, mask=keys_ok, other=0)
        kv_mask = keys_ok[:, None] & dims_ok[None, :]
        k_at = k_ptr + pool_rows[:, None] * k_token + kv_head * k_head + dims[None, :]
        k = tl.load(k_at, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (keys[None, :] <= positions[:, None]) & real[:, None]
        if WINDOW > 0:
            visible = visible & (keys[None, :] > positions[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, axis=1))
        safe_peak = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        alpha = tl.where(new_peak == peak, 1.0, tl.exp(peak - safe_peak))
        weights = tl.where(visible, tl.exp(scores - safe_peak[:, None]), 0.0)
        norm = norm * alpha + tl.sum(weights, axis=1)
        v_at = v_ptr + pool_rows[:, None] * v_token + kv_head * v_head + dims[None, :]
        v = tl.load(v_at, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None]
        acc += tl.dot(weights.to(dot_type), v, input_precision=PRECISION)
        peak = new_peak
    out = acc / tl.where(norm > 0, norm, 1.0)[:, None]
    out_at = out_ptr + tokens[:, None] * out_token + heads[:, None] * out_head + dims[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=real[:, None] & dims_ok[None, :])


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    keys: KeyTable,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [rows, Hq, D] over one layer's K/V [pool, Hkv, D] -> [rows, Hq, D] (checked).

    Rows past the batch's queries are zeros; `window`: each query sees its last `window`
    keys (None: all). Reads only shapes on the host.
    """
    _check(q, k_buffer, v_buffer, keys)
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be >= 1 key, got {window}")
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_buffer.shape[1]
    group = heads // kv_heads
    out = torch.zeros_like(q)  # [rows, Hq, D]
    if keys.num_tiles:
        tensors = (q, k_buffer, v_buffer, out)
        strides = [s for t in tensors for s in t.stride()[:2]]  # each one's token, head
        meta = {  # Triton's meta-parameters: compile-time constants, launch options
            "GROUP": group,
            "GROUP_PAD": triton.next_power_of_2(group),
            "HEAD_DIM": dim,
            "BLOCK_D": max(16, triton.next_power_of_2(dim)),
            "QUERY_BLOCK": QUERY_BLOCK,
            "KEY_BLOCK": KEY_BLOCK,
            "PRECISION": "ieee" if k_buffer.dtype == torch.float32 else "tf32",
            "WINDOW": window or 0,
            "num_warps": NUM_WARPS,
            "num_stages": NUM_STAGES,
        }
        _paged_attention_kernel[(keys.num_tiles, kv_heads)](
            *tensors, *keys.tensors, scale, *strides, **meta
        )
    return out


def _check(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, keys: KeyTable) -> None:
    if q.dim() != 3 or k_buffer.dim() != 3 or k_buffer.shape != v_buffer.shape:
        raise ValueError(
            f"need q [rows, heads, dim] and K, V [pool, kv heads, dim] of one shape, got "
            f"{tuple(q.shape)}, {tuple(k_buffer.shape)}, {tuple(v_buffer.shape)}"
        )
    if q.shape[2] != k_buffer.shape[2] or q.shape[1] % k_buffer.shape[1]:
        raise ValueError(
            f"{q.shape[1]} query heads of dim {q.shape[2]} do not group over "
            f"{k_buffer.shape[1]} KV heads of dim {k_buffer.shape[2]}"
        )
    if q.shape[0] < keys.num_queries:
        raise ValueError(f"q has {q.shape[0]} rows for {keys.num_queries} queries")
    tables = keys.tensors
    for tensor in (k_buffer, v_buffer, *tables):
        if tensor.device != q.device:
            raise ValueError(f"q is on {q.device}, a K/V buffer or table on {tensor.device}")
    if any(t.dtype != torch.int64 for t in tables):
        raise ValueError("the key table must be int64")
    if q.stride(2) != 1 or k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("q, K and V need a contiguous head dimension")
