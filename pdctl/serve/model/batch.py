"""What one forward is given: the pieces of a batch, and their layout on the device.

A `Piece` is the new tokens of one sequence. `ForwardBatch.build` lays a batch out
once per forward, on the host, and moves it to the device in one copy (pinned and
non-blocking on CUDA); every layer then reuses it (no host synchronisation inside the
forward). A decode step captured as a CUDA graph uses a fixed layout of the same
`ForwardBatch` instead (`decode_batch.py`). Attention reads the
keys of each piece straight from the KV pool through `KeyTable`:

    rows           piece 0's key rows 0..len0-1 | piece 1's 0..len1-1 | ...   [total keys]
                   ^ key_offsets[0]              ^ key_offsets[1]
    q (tokens)     piece 0's new tokens | piece 1's | ... | padding           [T padded]
                   ^ query_offsets[0]     ^ query_offsets[1]
    piece p        queries at positions starts[p] .. lengths[p]-1, keys 0 .. lengths[p]-1

Query tiles are QUERY_BLOCK positions of one piece, aligned on absolute positions
(tile_positions[t] is a multiple of QUERY_BLOCK), so a query always sits in the same
row of its tile whatever the batch or the chunking; rows outside the piece's new
tokens are masked. Knows nothing about pages, requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

QUERY_BLOCK = 16  # query positions per attention tile
KEY_BLOCK = 64  # key positions per attention block (a multiple of QUERY_BLOCK)
ALIGN = 16  # every table segment starts at a multiple of 16 elements (stable kernel specialisation)


@dataclass
class Piece:
    """New tokens of one sequence in a forward batch (host tensors)."""

    tokens: torch.Tensor  # [n] int64
    start: int  # position of tokens[0]
    rows: torch.Tensor  # [start + n] pool rows of positions 0..start+n-1
    want_logits: bool = True
    # multimodal: (index into tokens, [m, hidden] rows) that replace token embeddings
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class KeyTable:
    """Where each piece's queries and keys are, and the query tiles (device int64)."""

    rows: torch.Tensor  # [total keys] pool rows of every piece's keys, piece after piece
    key_offsets: torch.Tensor  # [pieces] where piece p's keys start in `rows`
    query_offsets: torch.Tensor  # [pieces] index of piece p's first new token in q
    starts: torch.Tensor  # [pieces] position of piece p's first new token
    lengths: torch.Tensor  # [pieces] keys of piece p: start + new tokens
    tile_pieces: torch.Tensor  # [tiles] the piece of each query tile
    tile_positions: torch.Tensor  # [tiles] first position of each tile (multiple of QUERY_BLOCK)
    num_queries: int  # new tokens in the batch (host value)
    max_keys: int  # the longest piece's keys (host value: padding of the torch path)
    # what the torch attention derives from this table alone, once a forward, not once
    # a layer (`attention.tile_layouts`); cleared at each forward's start (`runner.run`)
    derived: dict[object, object] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def num_tiles(self) -> int:
        return self.tile_pieces.shape[0]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The seven tables in field order (PIECE_TABLES, then TILE_TABLES), as the
        attention kernels take them."""
        return tuple(getattr(self, name) for name in PIECE_TABLES + TILE_TABLES)


# KeyTable's tensors: per piece, then per query tile
PIECE_TABLES = ("rows", "key_offsets", "query_offsets", "starts", "lengths")
TILE_TABLES = ("tile_pieces", "tile_positions")


@dataclass(frozen=True)
class ForwardBatch:
    """A batch on the device, built once per forward."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] absolute positions
    new_rows: torch.Tensor  # [T] pool rows the new tokens' K and V go to
    logit_rows: torch.Tensor  # [pieces wanting logits] index of each such piece's last token
    keys: KeyTable

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def build(pieces: Sequence[Piece], device: torch.device) -> ForwardBatch:
        if not pieces:
            raise ValueError("a forward needs at least one piece")
        counts = [p.tokens.numel() for p in pieces]
        lengths = [p.start + n for p, n in zip(pieces, counts, strict=True)]
        for piece, length in zip(pieces, lengths, strict=True):
            if piece.rows.numel() < length or not piece.tokens.numel():
                raise ValueError(
                    f"a piece of {piece.tokens.numel()} tokens at {piece.start} has "
                    f"{piece.rows.numel()} pool rows (needs at least one token and a row each)"
                )
        query_offsets = _running_offsets(counts)
        tiles = [
            (index, position)
            for index, (piece, length) in enumerate(zip(pieces, lengths, strict=True))
            for position in range(_tile_floor(piece.start), length, QUERY_BLOCK)
        ]
        wanted = [i for i, p in enumerate(pieces) if p.want_logits]
        ints = {
            "key_offsets": _running_offsets(lengths),
            "query_offsets": query_offsets,
            "starts": [p.start for p in pieces],
            "lengths": lengths,
            "tile_pieces": [index for index, _ in tiles],
            "tile_positions": [position for _, position in tiles],
            "logit_rows": [query_offsets[i] + counts[i] - 1 for i in wanted],
        }
        spans = list(zip(pieces, lengths, strict=True))
        d = _to_device(
            {
                "tokens": torch.cat([p.tokens for p in pieces]),
                "positions": torch.cat([torch.arange(p.start, n) for p, n in spans]),
                "new_rows": torch.cat([p.rows[p.start : n] for p, n in spans]),
                "rows": torch.cat([p.rows[:n] for p, n in spans]),
                **{name: torch.tensor(v, dtype=torch.int64) for name, v in ints.items()},
            },
            device,
        )
        tables = {name: d[name] for name in PIECE_TABLES + TILE_TABLES}
        keys = KeyTable(**tables, num_queries=sum(counts), max_keys=max(lengths))
        return ForwardBatch(d["tokens"], d["positions"], d["new_rows"], d["logit_rows"], keys)


def _running_offsets(sizes: list[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def _tile_floor(position: int) -> int:
    return position - position % QUERY_BLOCK


def _to_device(segments: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """One host-to-device copy of every segment (int64), each starting ALIGN-aligned.

    On CUDA the staging is pinned and the copy non-blocking: the host never waits for
    the device here (a pageable copy would). Torch's pinned-memory cache keeps the
    block until the copy has finished, so a later forward never overwrites it early.
    """
    sizes = {name: t.numel() for name, t in segments.items()}
    spans = {name: -(-size // ALIGN) * ALIGN for name, size in sizes.items()}
    pinned, total = device.type == "cuda", sum(spans.values())
    packed = torch.zeros(total, dtype=torch.int64, pin_memory=pinned)  # [sum of aligned spans]
    at, starts = 0, {}
    for name, tensor in segments.items():
        packed[at : at + sizes[name]] = tensor.reshape(-1)
        starts[name] = at
        at += spans[name]
    packed = packed.to(device, non_blocking=pinned)
    return {name: packed[starts[name] : starts[name] + sizes[name]] for name in segments}
