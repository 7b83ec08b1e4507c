"""Attention, batch- and chunk-invariant: the decoder's over paged KV, the encoder's dense.

`paged_attention` computes causal grouped-query attention for every piece of a batch
at once, reading K and V straight from the pool's per-layer buffers through the
batch's `KeyTable` (no per-piece loop, no copy of a piece's keys first). On CUDA and
XPU it is one launch of the Triton kernel (`triton_attention.py`) in both serving
modes (it is fixed-order and the fast path); on the CPU with a float32 cache, the C
kernel (`native_attention.py`: one query row at a time over its own keys);
elsewhere `paged_attention_reference`, the torch path with the same signature. The
kernel and the torch path reduce in a fixed order that depends only on a query's
absolute position:

- keys in blocks of KEY_BLOCK absolute positions, block 0 first; a block a query may
  not see adds exact zeros, so the sums do not depend on how many keys the batch
  has, on chunking or on where the keys came from (a prefix-cache hit);
- queries in tiles of QUERY_BLOCK absolute positions (`batch.py`), so a query always
  takes the same row of every product.

A sliding window (`window`, Mistral's `sliding_window`) hides keys older than the last
`window` positions: query i sees keys j with i - window < j <= i. Hidden keys are masked
exactly like future ones (exact zeros in the same fixed block order), so the window
changes which keys count, never the order of the sums.

The torch path takes the softmax maximum over all visible keys (exact in any order)
and sums blocks with a sequential cumulative sum; the kernel keeps an online maximum,
so the two agree to rounding, not bitwise. `sequence_attention` is the dense
attention of one sequence (the image encoder's). Knows nothing about pages or
requests: only rows of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdctl.serve.model import native_attention, ops
from pdctl.serve.model.batch import KEY_BLOCK, QUERY_BLOCK, KeyTable


def paged_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    keys: KeyTable,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [rows, Hq, D] (rows >= keys.num_queries) over one layer's K/V [pool, Hkv, D].

    Returns [rows, Hq, D]: row i is query i's attention output; rows past the batch's
    queries are zeros. `window`: each query sees only its last `window` keys (None: all).
    """
    if ops.triton_available(q.device.type):  # fixed-order and fast: both serving modes
        from pdctl.serve.model import triton_attention

        return triton_attention.paged_attention(q, k_buffer, v_buffer, keys, scale, window)
    if native_attention.serves(q, k_buffer):  # the CPU's float32: one row at a time, in C
        return native_attention.paged_attention(q, k_buffer, v_buffer, keys, scale, window)
    return paged_attention_reference(q, k_buffer, v_buffer, keys, scale, window)


def paged_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    keys: KeyTable,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The torch path of `paged_attention` (same signature), batched over query tiles.

    Every product has one shape whatever the batch (a tile's G*QUERY_BLOCK query rows
    against one KEY_BLOCK of keys); only the number of products changes. Tiles are
    computed in buckets (`tile_buckets`), each up to the last key block one of its
    tiles may see, not the batch's longest piece: a prompt's early tiles skip the key
    blocks in their future (exact zeros either way, see the module's docstring). What
    depends on the key table alone (buckets, query and key indices, the visibility
    mask) is derived once a forward and kept with the table (`tile_layouts`).
    """
    rows, heads, dim = q.shape
    result = q.new_zeros((rows + 1, heads, dim))  # [rows + 1, Hq, D]: masked tile rows land last
    for layout in tile_layouts(keys, window):
        out = _attend_tiles(q, k_buffer, v_buffer, layout, scale)
        result.index_copy_(0, layout.target(rows), out)
    return result[:rows]


# A bucket more costs about this many tile x key-block products (its dozen launches on
# the host); a bucket is split off only where it saves more than that.
BUCKET_COST = 8


def tile_buckets(keys: KeyTable) -> list[tuple[torch.Tensor | None, int]]:
    """(tile indices, key blocks) per bucket; (None, all blocks) when one bucket serves.

    A tile may see keys up to its last query's position (tiles never straddle a key
    block: KEY_BLOCK is a multiple of QUERY_BLOCK), so it needs blocks up to its own.
    Tiles are grouped from the furthest down; a group joins the bucket above it when
    the blocks it would compute in vain cost less than a bucket more. Host values
    only on the CPU (elsewhere one bucket: no device-to-host read in a step).
    """
    blocks = max(1, ops.round_up(keys.max_keys, KEY_BLOCK) // KEY_BLOCK)
    if keys.tile_positions.device.type != "cpu" or keys.num_tiles < 2:
        return [(None, blocks)]
    positions = keys.tile_positions.tolist()
    ends = (keys.lengths[keys.tile_pieces] - 1).tolist()
    needs = [
        min(p + QUERY_BLOCK - 1, e) // KEY_BLOCK + 1 for p, e in zip(positions, ends, strict=True)
    ]
    by_need: dict[int, list[int]] = {}
    for tile, need in enumerate(needs):
        by_need.setdefault(need, []).append(tile)
    buckets: list[tuple[list[int], int]] = []
    for need in sorted(by_need, reverse=True):
        tiles = by_need[need]
        if buckets and len(tiles) * (buckets[-1][1] - need) <= BUCKET_COST:
            buckets[-1][0].extend(tiles)
        else:
            buckets.append((list(tiles), need))
    if len(buckets) == 1:
        return [(None, buckets[0][1])]
    device = keys.tile_positions.device
    return [(torch.tensor(sorted(t), dtype=torch.int64, device=device), b) for t, b in buckets]


@dataclass(frozen=True)
class TileLayout:
    """One bucket's tiles as every layer's attention reads them (layer-independent).

    Shapes: query_index, query_ok, positions [tiles, QB]; pool_rows and key_ok
    [tiles, blocks * KB]; visible [tiles, blocks, QB, KB] (the window applied)."""

    tiles: int
    blocks: int
    query_index: torch.Tensor
    query_ok: torch.Tensor
    pool_rows: torch.Tensor
    key_ok: torch.Tensor
    visible: torch.Tensor

    def target(self, rows: int) -> torch.Tensor:
        """The row of q each output row goes to; `rows` (past q's) for padding rows."""
        return torch.where(self.query_ok, self.query_index, rows).reshape(-1)


def tile_layouts(keys: KeyTable, window: int | None) -> list[TileLayout]:
    """The buckets' layouts, derived once a forward (kept in `keys.derived`)."""
    found = keys.derived.get(("tiles", window))
    if found is None:
        found = [_layout(keys, subset, blocks, window) for subset, blocks in tile_buckets(keys)]
        keys.derived[("tiles", window)] = found
    return found  # type: ignore[return-value]


def _layout(
    keys: KeyTable, subset: torch.Tensor | None, blocks: int, window: int | None
) -> TileLayout:
    pieces = keys.tile_pieces if subset is None else keys.tile_pieces[subset]
    starts = keys.tile_positions if subset is None else keys.tile_positions[subset]
    query_index, query_ok, positions = _tile_queries(keys, pieces, starts)  # [tiles, QB] each
    pool_rows, key_ok = _tile_key_rows(keys, pieces, blocks)
    device = pieces.device
    key_positions = torch.arange(blocks * KEY_BLOCK, device=device).view(blocks, KEY_BLOCK)
    tiles = pieces.shape[0]
    key_ok_blocks = key_ok.view(tiles, blocks, KEY_BLOCK)
    visible = (key_positions[None, :, None, :] <= positions[:, None, :, None]) & (
        query_ok[:, None, :, None] & key_ok_blocks[:, :, None, :]
    )  # [tiles, blocks, QB, KEY_BLOCK]
    if window is not None:  # keys older than the window are hidden like future ones
        visible &= key_positions[None, :, None, :] > positions[:, None, :, None] - window
    return TileLayout(tiles, blocks, query_index, query_ok, pool_rows, key_ok, visible)


def _attend_tiles(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layout: TileLayout,
    scale: float,
) -> torch.Tensor:
    """Attention of a bucket's tiles over key blocks 0..blocks-1: [tiles * QUERY_BLOCK,
    Hq, D] outputs (`layout.target` says which row of q each goes to)."""
    _, heads, dim = q.shape
    kv_heads = k_buffer.shape[1]
    group = heads // kv_heads
    tiles, blocks = layout.tiles, layout.blocks
    tile_q = torch.where(layout.query_ok[:, :, None, None], q[layout.query_index], 0)
    tile_q = tile_q.view(tiles, QUERY_BLOCK, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    tile_q = tile_q.reshape(tiles * kv_heads, 1, group * QUERY_BLOCK, dim)
    k = _gather_keys(k_buffer, layout, q.dtype)  # [tiles * Hkv, blocks, KEY_BLOCK, D]
    v = _gather_keys(v_buffer, layout, q.dtype)
    rows_per_tile = group * QUERY_BLOCK
    tile_q = tile_q.expand(-1, blocks, -1, -1).reshape(-1, rows_per_tile, dim)
    scores = ops.product(tile_q, k.reshape(-1, KEY_BLOCK, dim).transpose(1, 2)) * scale
    scores = scores.view(tiles, kv_heads, blocks, group, QUERY_BLOCK, KEY_BLOCK)
    scores = scores.masked_fill(~layout.visible[:, None, :, None], float("-inf"))
    out = _combine_blocks(scores.view(tiles * kv_heads, blocks, rows_per_tile, KEY_BLOCK), v)
    out = out.view(tiles, kv_heads, group, QUERY_BLOCK, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(-1, heads, dim)


def _tile_queries(
    keys: KeyTable, pieces: torch.Tensor, tile_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile row: index of its query in q (0 when masked), whether real, position."""
    offsets = torch.arange(QUERY_BLOCK, device=pieces.device)
    positions = tile_positions[:, None] + offsets  # [tiles, QB]
    starts = keys.starts[pieces][:, None]
    real = (positions >= starts) & (positions < keys.lengths[pieces][:, None])
    index = torch.where(real, keys.query_offsets[pieces][:, None] + positions - starts, 0)
    return index, real, positions


def _tile_key_rows(
    keys: KeyTable, pieces: torch.Tensor, blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's keys 0..blocks*KEY_BLOCK-1: their pool rows (0 where not real) and
    which are real, [tiles, blocks * KEY_BLOCK] each."""
    key_positions = torch.arange(blocks * KEY_BLOCK, device=pieces.device)
    real = key_positions[None, :] < keys.lengths[pieces][:, None]
    at = torch.where(real, keys.key_offsets[pieces][:, None] + key_positions, 0)
    return keys.rows[at], real


def _gather_keys(buffer: torch.Tensor, layout: TileLayout, dtype: torch.dtype) -> torch.Tensor:
    """One layer's K or V of the tiles' keys, [tiles * Hkv, blocks, KEY_BLOCK, D] (zeros
    where no key is)."""
    tiles, blocks = layout.tiles, layout.blocks
    kv_heads, dim = buffer.shape[1], buffer.shape[2]
    values = torch.where(layout.key_ok[:, :, None, None], buffer[layout.pool_rows].to(dtype), 0)
    values = values.view(tiles, blocks, KEY_BLOCK, kv_heads, dim).permute(0, 3, 1, 2, 4)
    return values.reshape(tiles * kv_heads, blocks, KEY_BLOCK, dim)


def _combine_blocks(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted values from per-block scores, blocks summed in order.

    scores [B, blocks, M, KB] (masked: -inf), values [B, blocks, KB, D] -> [B, M, D].
    """
    batch, blocks, rows, width = scores.shape
    peak = scores.amax(dim=(1, 3), keepdim=True)  # exact, order-free
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)  # masked keys -> exactly 0
    norm = ops.row_sums(weights)[..., 0].cumsum(dim=1)[:, -1, :, None]  # [B, M, 1]
    partial = ops.product(
        weights.reshape(batch * blocks, rows, width), values.reshape(batch * blocks, width, -1)
    ).view(batch, blocks, rows, -1)
    out = partial.cumsum(dim=1)[:, -1]  # [B, M, D], blocks summed in order
    return out / torch.where(norm > 0, norm, torch.ones_like(norm))


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one sequence (dense K and V), batch- and chunk-invariant.

    q [n, Hq, D] at absolute positions `query_positions` [n]; k, v [Tk, Hkv, D] hold
    keys 0..Tk-1 of the same sequence. Query i sees keys j <= query_positions[i].
    Returns [n, Hq, D].
    """
    n, heads, dim = q.shape
    keys, kv_heads, _ = k.shape
    group = heads // kv_heads
    n_pad = max(ops.TILE, ops.round_up(n, ops.TILE))
    k_pad = max(KEY_BLOCK, ops.round_up(keys, KEY_BLOCK))
    blocks = k_pad // KEY_BLOCK
    q_h = q.new_zeros((heads, n_pad, dim))
    q_h[:, :n] = q.transpose(0, 1)
    k_h = k.new_zeros((kv_heads, k_pad, dim))
    k_h[:, :keys] = k.transpose(0, 1)
    v_h = v.new_zeros((kv_heads, k_pad, dim))
    v_h[:, :keys] = v.transpose(0, 1)
    if group > 1:  # grouped-query attention: each KV head serves `group` query heads
        k_h = k_h.repeat_interleave(group, dim=0)
        v_h = v_h.repeat_interleave(group, dim=0)
    scores = ops.product(q_h, k_h.transpose(1, 2)) * scale  # [heads, n_pad, k_pad]
    visible = torch.zeros((n_pad, k_pad), dtype=torch.bool, device=q.device)
    key_index = torch.arange(k_pad, device=q.device)
    visible[:n] = key_index[None, :] <= query_positions[:, None]
    visible[:, keys:] = False
    scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)  # exact, order-free
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)  # masked keys -> exactly 0
    block_weights = weights.view(heads, n_pad, blocks, KEY_BLOCK)
    norm = ops.row_sums(block_weights)[..., 0].cumsum(dim=-1)[..., -1:]  # [heads, n_pad, 1]
    values = v_h.view(heads, blocks, KEY_BLOCK, dim)
    partial = _block_values(block_weights, values)  # [heads, blocks, n_pad, dim]
    out = partial.cumsum(dim=1)[:, -1]  # [heads, n_pad, dim], blocks summed in order
    out = out / torch.where(norm > 0, norm, torch.ones_like(norm))
    return out[:, :n].transpose(0, 1).contiguous()


def _block_values(block_weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per key block: weights [H, n, B, KB] @ values [H, B, KB, D] -> [H, B, n, D]."""
    heads, n_pad, blocks, width = block_weights.shape
    left = block_weights.permute(0, 2, 1, 3).reshape(heads * blocks, n_pad, width)
    right = values.reshape(heads * blocks, width, values.shape[-1])
    return ops.product(left, right).view(heads, blocks, n_pad, values.shape[-1])
