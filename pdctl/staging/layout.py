"""Which KV heads go where, and how they are laid out in a staging region.

Head slices, for H KV heads, prefill TP p and decode TP d. A rank holds H/tp
consecutive heads, or one replicated head when tp > H (GQA replication):

    H=4, prefill TP1 -> decode TP2      H=4, prefill TP2 -> decode TP1
    prefill r0: [h0 h1 h2 h3]           prefill r0: [h0 h1]  r1: [h2 h3]
    decode  r0: [h0 h1] <- r0[0:2]      decode  r0: [h0 h1 h2 h3]
    decode  r1: [h2 h3] <- r0[2:4]                   ^ r0[0:2] ^ r1[0:2]

Each decode rank receives one `HeadSlice` per prefill rank that holds some of its
heads. When prefill replicates a head over several ranks, the replica is chosen by
decode rank so the writes spread over prefill ranks.

A staging region holds one segment of T tokens for one decode rank. Writers are
laid out one after another, each as all layers, K then V, token-major:

    offset 0                              block(w=1)
    | w0: L0.K | L0.V | L1.K | ... | Ln.V | w1: L0.K | L0.V | ... | Ln.V |
           [T, h0, D] each                       [T, h1, D] each

    block(w) = 2 * L * T * D * elem * (h0 + ... + h(w-1))

So a writer's block is contiguous (one transport write per writer and segment) and
scatters into heads [dst_head_start, dst_head_start + h_w) of every layer.
Requests larger than a segment are cut on page boundaries (`plan_segments`).
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_tp(num_kv_heads: int, tp: int, what: str) -> None:
    if num_kv_heads < 1 or tp < 1:
        raise ValueError(f"{what}: KV heads ({num_kv_heads}) and TP ({tp}) must be >= 1")
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise ValueError(f"{what}: TP {tp} does not divide {num_kv_heads} KV heads")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise ValueError(f"{what}: TP {tp} is not a multiple of {num_kv_heads} KV heads")


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> range:
    """Global KV head indices rank `rank` stores, in local order."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside TP {tp}")
    if tp <= num_kv_heads:
        per_rank = num_kv_heads // tp
        return range(rank * per_rank, (rank + 1) * per_rank)
    replicas = tp // num_kv_heads
    head = rank // replicas
    return range(head, head + 1)


@dataclass(frozen=True)
class KVSlice:
    """Heads [head_start, +num_heads) of every layer's K and V in a pool of pages of
    `page_size` tokens: what one checked gather, scatter, page digest or mapped write
    reads or writes (`kernels`). The buffers say the rest (head_dim, dtype, strides)."""

    head_start: int  # among the rank's local heads
    num_heads: int
    page_size: int


@dataclass(frozen=True)
class HeadSlice:
    """Heads one prefill rank writes into one decode rank's KV."""

    prefill_rank: int
    src_head_start: int  # among the prefill rank's local heads
    dst_head_start: int  # among the decode rank's local heads
    num_heads: int

    def source(self, page_size: int) -> KVSlice:
        """The heads read on the prefill rank."""
        return KVSlice(self.src_head_start, self.num_heads, page_size)

    def destination(self, page_size: int) -> KVSlice:
        """The heads written on the decode rank."""
        return KVSlice(self.dst_head_start, self.num_heads, page_size)


def _holder(num_kv_heads: int, prefill_tp: int, head: int, decode_rank: int) -> int:
    if prefill_tp <= num_kv_heads:
        return head // (num_kv_heads // prefill_tp)
    replicas = prefill_tp // num_kv_heads
    return head * replicas + decode_rank % replicas


def head_slices(
    num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int
) -> tuple[HeadSlice, ...]:
    """The slices decode rank `decode_rank` receives, ordered by destination head."""
    _check_tp(num_kv_heads, prefill_tp, "prefill")
    _check_tp(num_kv_heads, decode_tp, "decode")
    slices: list[HeadSlice] = []
    for dst, head in enumerate(rank_heads(num_kv_heads, decode_tp, decode_rank)):
        holder = _holder(num_kv_heads, prefill_tp, head, decode_rank)
        src = rank_heads(num_kv_heads, prefill_tp, holder).index(head)
        last = slices[-1] if slices else None
        if (
            last is not None
            and last.prefill_rank == holder
            and last.src_head_start + last.num_heads == src
            and last.dst_head_start + last.num_heads == dst
        ):
            slices[-1] = HeadSlice(
                holder, last.src_head_start, last.dst_head_start, last.num_heads + 1
            )
        else:
            slices.append(HeadSlice(holder, src, dst, 1))
    return tuple(slices)


def writers_of(
    num_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int
) -> dict[int, HeadSlice]:
    """Prefill side: decode rank -> the slice this prefill rank must send it."""
    found: dict[int, HeadSlice] = {}
    for decode_rank in range(decode_tp):
        for piece in head_slices(num_kv_heads, prefill_tp, decode_tp, decode_rank):
            if piece.prefill_rank == prefill_rank:
                found[decode_rank] = piece
    return found


@dataclass(frozen=True)
class StagingLayout:
    """Byte layout of one decode rank's staging region (see the module docstring)."""

    num_layers: int
    head_dim: int
    elem_bytes: int
    slices: tuple[HeadSlice, ...]

    @property
    def num_heads(self) -> int:
        return sum(piece.num_heads for piece in self.slices)

    def head_bytes_per_token(self) -> int:
        """Bytes of one head of one token across all layers, K and V."""
        return 2 * self.num_layers * self.head_dim * self.elem_bytes

    def bytes_per_token(self) -> int:
        return self.head_bytes_per_token() * self.num_heads

    def region_bytes(self, num_tokens: int) -> int:
        return self.bytes_per_token() * num_tokens

    def block_offset(self, writer: int, num_tokens: int) -> int:
        heads_before = sum(piece.num_heads for piece in self.slices[:writer])
        return self.head_bytes_per_token() * num_tokens * heads_before

    def block_bytes(self, writer: int, num_tokens: int) -> int:
        return self.head_bytes_per_token() * num_tokens * self.slices[writer].num_heads

    def writer_index(self, prefill_rank: int) -> int:
        for index, piece in enumerate(self.slices):
            if piece.prefill_rank == prefill_rank:
                return index
        raise KeyError(f"prefill rank {prefill_rank} writes nothing to this decode rank")


@dataclass(frozen=True)
class Segment:
    index: int
    page_start: int  # index into the request's page list
    num_pages: int

    def num_tokens(self, page_size: int) -> int:
        return self.num_pages * page_size


class SegmentTooSmall(ValueError):
    """A segment cannot hold even one page of one decode rank."""


def plan_segments(
    num_pages: int, page_size: int, bytes_per_token: int, max_segment_bytes: int
) -> tuple[Segment, ...]:
    """Cut a request of `num_pages` pages into page-aligned segments that fit.

    Both sides compute the same plan from the same numbers, so segment `i` means the
    same pages to prefill and decode.
    """
    if num_pages < 0 or page_size < 1 or bytes_per_token < 1:
        raise ValueError("num_pages >= 0, page_size >= 1 and bytes_per_token >= 1 are required")
    page_bytes = bytes_per_token * page_size
    pages_per_segment = max_segment_bytes // page_bytes
    if pages_per_segment < 1:
        raise SegmentTooSmall(
            f"a segment of {max_segment_bytes} bytes cannot hold one page of {page_bytes} bytes"
        )
    return tuple(
        Segment(index, start, min(pages_per_segment, num_pages - start))
        for index, start in enumerate(range(0, num_pages, pages_per_segment))
    )
