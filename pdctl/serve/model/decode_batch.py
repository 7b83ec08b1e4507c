"""The fixed layout of a decode batch: one bucket's static inputs, for a CUDA graph.

A captured graph reads its inputs at fixed device addresses with fixed shapes, so a
decode batch (every piece one new token) is laid out in a bucket of `size` pieces
whose tables have the same size whatever the batch: the kernels' grids (query tiles x
KV heads) depend only on the bucket, and everything else they read (where a piece's
keys start, how many it has) is device data. One int64 buffer holds it all, on the
host (pinned on CUDA) and on the device, in the same layout:

    fields [NUM_FIELDS, stride], stride = size rounded up to ALIGN (every field aligned):
      tokens | starts (= positions) | lengths | key_offsets | tile_positions | new_rows
      | query_offsets | tile_pieces | logit_rows              (the last three: 0..size-1)
    rows [size * capacity + 1]:
      piece 0's key rows | piece 1's | ... | scratch | (stale, never read)
      ^ key_offsets[0]     ^ key_offsets[1]  ^ total keys: every padding piece's one key

Piece p < n (the batch) is its token at position starts[p] with keys 0..starts[p];
piece p >= n is padding: token 0 at position 0, its K and V written to `scratch_row`,
its one key that row. Rows are computed independently (`ops.py`), so padding never
reaches a real piece's numbers, and its writes never reach a request's KV. A step
rewrites the fields and the rows up to the scratch entry on the host, then starts one
non-blocking copy of that prefix: the host never waits for the device.

`capacity` is the longest context the table takes per piece (the runner's max
context). Knows nothing about pages or requests: the scratch row is a pool row the
caller reserved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdctl.serve.model import ops
from pdctl.serve.model.batch import ALIGN, QUERY_BLOCK, ForwardBatch, KeyTable, Piece
from pdctl.staging import device as dev

TOKENS, STARTS, LENGTHS, KEY_OFFSETS, TILE_POSITIONS, NEW_ROWS = range(6)
QUERY_OFFSETS, TILE_PIECES, LOGIT_ROWS = range(6, 9)  # static: piece p's token, tile, logits
NUM_FIELDS = 9


def decode_refusal(pieces: Sequence[Piece], capacity: int) -> str | None:
    """Why `pieces` cannot take a fixed decode layout of `capacity` keys a piece (None: it can).

    The reasons are fixed phrases (no numbers), so a caller can log each one once.
    """
    if not pieces:
        return "an empty batch"
    for piece in pieces:
        if piece.tokens.numel() != 1:
            return "a piece of more than one new token (prefill)"
        if piece.embeds:
            return "multimodal embeddings"
        if not piece.want_logits:
            return "a piece that wants no logits"
        if piece.start >= capacity:
            return "a context past the key table's capacity"
        if piece.rows.numel() <= piece.start:
            return "a piece with fewer pool rows than keys"
    return None


class DecodeLayout:
    """One bucket's static inputs: the host staging, its device twin and the batch over it."""

    def __init__(self, size: int, capacity: int, scratch_row: int, device: torch.device) -> None:
        if size < 1 or capacity < 1 or scratch_row < 0:
            raise ValueError(
                f"a decode layout needs a size and capacity >= 1 and a scratch row >= 0, got "
                f"{size}, {capacity}, {scratch_row}"
            )
        self.size, self.capacity, self.scratch_row = size, capacity, scratch_row
        self.device = device
        self._pinned = device.type == "cuda"
        stride = ops.round_up(size, ALIGN)
        self._rows_at = NUM_FIELDS * stride
        length = self._rows_at + size * capacity + 1
        self.host = torch.zeros(length, dtype=torch.int64, pin_memory=self._pinned)
        # [NUM_FIELDS * stride + size * capacity + 1], the layout above
        self.on_device = torch.zeros(length, dtype=torch.int64, device=device)  # the same layout
        self._fields = self.host[: self._rows_at].view(NUM_FIELDS, stride)  # [NUM_FIELDS, stride]
        self._fields[QUERY_OFFSETS:] = torch.arange(stride)
        self._rows = self.host[self._rows_at :]  # [size * capacity + 1]
        # a padding piece's fields TOKENS..NEW_ROWS (KEY_OFFSETS: the scratch entry, per step)
        self._padding = torch.tensor([0, 0, 1, 0, 0, scratch_row])[:, None]  # [6, 1]
        self._copied = dev.create_device_event(device) if self._pinned else None
        self.batch = self._device_batch()
        self.fill([])

    def fill(self, pieces: Sequence[Piece]) -> None:
        """Lay `pieces` out (checked by `decode_refusal`), padded, and start the copy.

        The staging is rewritten only once the last step's copy has read it: in steady
        state that copy finished long ago (the caller read that step's logits).
        """
        if len(pieces) > self.size:
            raise ValueError(f"{len(pieces)} pieces for a decode layout of {self.size}")
        if pieces and (problem := decode_refusal(pieces, self.capacity)):
            raise ValueError(f"no decode layout for this batch: {problem}")
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the last copy still reads the staging (rare: see fill)
        total = self._write_pieces(pieces)
        count, fields = len(pieces), self._fields
        fields[:KEY_OFFSETS, count : self.size] = self._padding[:KEY_OFFSETS]
        fields[KEY_OFFSETS, count : self.size] = total  # the scratch entry
        fields[TILE_POSITIONS : NEW_ROWS + 1, count : self.size] = self._padding[TILE_POSITIONS:]
        self._rows[total] = self.scratch_row
        end = self._rows_at + total + 1
        self.on_device[:end].copy_(self.host[:end], non_blocking=self._pinned)
        if self._copied is not None:
            self._copied.record(dev.current_device_stream(self.device))

    def _write_pieces(self, pieces: Sequence[Piece]) -> int:
        """The real pieces' fields and key rows, on the host; returns their keys in all."""
        if not pieces:
            return 0
        count = len(pieces)
        starts = [piece.start for piece in pieces]
        lengths = [start + 1 for start in starts]
        offsets = [0] * count
        for index in range(1, count):
            offsets[index] = offsets[index - 1] + lengths[index - 1]
        tiles = [start - start % QUERY_BLOCK for start in starts]
        ints = torch.tensor([starts, lengths, offsets, tiles])  # [4, count]
        self._fields[STARTS : TILE_POSITIONS + 1, :count] = ints
        self._fields[TOKENS, :count] = torch.cat([piece.tokens for piece in pieces])
        total = offsets[-1] + lengths[-1]
        keys = [piece.rows[:length] for piece, length in zip(pieces, lengths, strict=True)]
        torch.cat(keys, out=self._rows[:total])
        self._fields[NEW_ROWS, :count] = self._rows[ints[2] + ints[0]]  # each new token's row
        return total

    def _device_batch(self) -> ForwardBatch:
        fields = self.on_device[: self._rows_at].view(self._fields.shape)

        def field(index: int) -> torch.Tensor:
            return fields[index, : self.size]  # [size]

        keys = KeyTable(
            rows=self.on_device[self._rows_at :],
            key_offsets=field(KEY_OFFSETS),
            query_offsets=field(QUERY_OFFSETS),
            starts=field(STARTS),
            lengths=field(LENGTHS),
            tile_pieces=field(TILE_PIECES),
            tile_positions=field(TILE_POSITIONS),
            num_queries=self.size,
            max_keys=self.capacity,
        )
        return ForwardBatch(field(TOKENS), field(STARTS), field(NEW_ROWS), field(LOGIT_ROWS), keys)
