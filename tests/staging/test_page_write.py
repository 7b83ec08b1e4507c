"""The direct page write (copy and digests in one read) against the torch reference, bit for bit.

The Triton kernel runs interpreted on the CPU here; the target buffers stand in for a
peer's pool mapped into this process (on a GPU, `Transport.mapped_view` gives them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdctl.staging.kernels import KVSlice, slice_digests
from pdctl.staging.kernels.page_write import PeerPages, start_slice_write, write_pages_reference
from tests.staging.kv_factory import as_bits, random_kv, random_pages

CUDA = torch.cuda.is_available()


def _target(layers: int, pool_pages: int, page_size: int, heads: int, head_dim: int, dtype, device):
    k, v = random_kv(layers, pool_pages * page_size, heads, head_dim, dtype, 99, device)
    return [b for pair in zip(k, v, strict=True) for b in pair]


@pytest.mark.parametrize(
    ("dtype", "page_size", "src_split", "dst_split", "segments"),
    [
        (torch.bfloat16, 1, (8, 4, 4), (4, 0), [(0, 6)]),  # TP1 -> TP2: the upper half
        (torch.bfloat16, 4, (8, 0, 8), (8, 0), [(0, 2), (2, 3), (5, 1)]),  # whole rows
        (torch.float32, 16, (4, 1, 2), (2, 0), [(0, 1), (1, 5)]),  # TP2 -> TP1 style
        (torch.float16, 2, (2, 1, 1), (4, 3), [(3, 3), (0, 3)]),  # into a wider row
    ],
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_page_write_lands_the_reference_bytes_with_their_digests(
    dtype, page_size, src_split, dst_split, segments, backend
) -> None:
    heads, start, count = src_split
    dst_heads, dst_start = dst_split
    layers, pool_pages, head_dim = 3, 10, 16
    k, v = random_kv(layers, pool_pages * page_size, heads, head_dim, dtype, 7, "cpu")
    pages = random_pages(pool_pages, 6, 7)
    dst_pages = random_pages(12, 6, 8)
    got = _target(layers, 12, page_size, dst_heads, head_dim, dtype, "cpu")
    expected = [b.clone() for b in got]
    heads = KVSlice(start, count, page_size)
    write_pages_reference(k, v, pages, PeerPages(expected, dst_pages, dst_start), heads)
    target = PeerPages(got, dst_pages, dst_start)
    digests = start_slice_write(k, v, pages, target, segments, heads, backend=backend).result()
    for landed, wanted in zip(got, expected, strict=True):
        assert torch.equal(as_bits(landed), as_bits(wanted))
    assert digests == slice_digests(k, v, pages, segments, heads)
    landed_k, landed_v = got[0::2], got[1::2]  # what the peer computes over its pages
    landed_heads = KVSlice(dst_start, count, page_size)
    assert digests == slice_digests(landed_k, landed_v, dst_pages, segments, landed_heads)
    untouched = torch.ones(12 * page_size, dtype=torch.bool)
    for page in dst_pages.tolist():
        untouched[page * page_size : (page + 1) * page_size] = False
    fresh = _target(layers, 12, page_size, dst_heads, head_dim, dtype, "cpu")
    for landed, before in zip(got, fresh, strict=True):  # rows of other pages keep their bits
        assert torch.equal(as_bits(landed)[untouched], as_bits(before)[untouched])


def test_the_reference_really_moves_the_slice() -> None:
    k, v = random_kv(1, 8, 4, 16, torch.float32, 3, "cpu")
    target = _target(1, 8, 1, 2, 16, torch.float32, "cpu")
    write_pages_reference(k, v, [5], PeerPages(target, [2], 0), KVSlice(2, 2, 1))
    bits = [as_bits(t) for t in target]
    assert torch.equal(bits[0][2], as_bits(k[0])[5, 2:4])
    assert torch.equal(bits[1][2], as_bits(v[0])[5, 2:4])
    assert not torch.equal(bits[0][3], as_bits(k[0])[5, 2:4])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(dst_pages=[0, 1]), "the target names 2 pages for the source's 3"),
        (dict(dst_pages=[0, 1, 1]), "page index 1 appears more than once"),
        (dict(dst_pages=[0, 1, 8]), "page index 8 is outside the pool's 8 pages"),
        (dict(dst_start=1), r"target heads \[1, 3\) are outside the target's 2 KV heads"),
        (dict(layers=2), "the target has 4 buffers; the source's 1 layers need 2"),
        (dict(dtype=torch.float16), "every one must be a contiguous"),
    ],
)
def test_a_bad_target_is_refused_before_any_byte_moves(change, message) -> None:
    k, v = random_kv(1, 8, 2, 16, torch.float32, 1, "cpu")
    target = _target(1, 8, 1, 2, 16, change.get("dtype", torch.float32), "cpu")
    if change.get("layers") == 2:
        target = target + target  # K and V for two layers: one layer too many
    before = [b.clone() for b in target]
    peer = PeerPages(target, change.get("dst_pages", [3, 4, 5]), change.get("dst_start", 0))
    with pytest.raises(ValueError, match=message):
        start_slice_write(k, v, [0, 1, 2], peer, [(0, 3)], KVSlice(0, 2, 1), backend="triton")
    assert all(torch.equal(as_bits(a), as_bits(b)) for a, b in zip(target, before, strict=True))


def test_a_changed_bit_changes_its_segment_digest_only() -> None:
    k, v = random_kv(2, 16, 2, 16, torch.bfloat16, 4, "cpu")
    target = _target(2, 16, 4, 2, 16, torch.bfloat16, "cpu")
    peer, segments, heads = PeerPages(target, [2, 3], 0), [(0, 1), (1, 1)], KVSlice(0, 2, 4)
    before = start_slice_write(k, v, [0, 1], peer, segments, heads, backend="triton").result()
    as_bits(v[1])[5, 1, 2] ^= 1  # page 1 (segment 1), layer 1's V
    after = start_slice_write(k, v, [0, 1], peer, segments, heads, backend="triton").result()
    assert after[0] == before[0]
    assert after[1][3] != before[1][3] and after[1][:3] == before[1][:3]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_page_write_on_the_device_equals_the_host_reference() -> None:
    k, v = random_kv(16, 64 * 16, 8, 128, torch.bfloat16, 5, "cpu")
    pages, dst_pages = random_pages(64, 40, 5), random_pages(64, 40, 6)
    segments = [(0, 16), (16, 16), (32, 8)]
    host_target = _target(16, 64, 16, 4, 128, torch.bfloat16, "cpu")
    device_target = [b.cuda() for b in host_target]
    heads = KVSlice(4, 4, 16)
    write_pages_reference(k, v, pages, PeerPages(host_target, dst_pages, 0), heads)
    kc, vc = [t.cuda() for t in k], [t.cuda() for t in v]
    target = PeerPages(device_target, dst_pages, 0)
    digests = start_slice_write(kc, vc, pages, target, segments, heads).result()
    assert digests == slice_digests(k, v, pages, segments, heads)
    for landed, wanted in zip(device_target, host_target, strict=True):
        assert torch.equal(as_bits(landed.cpu()), as_bits(wanted))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_replayed_writes_land_their_own_bytes_and_digests() -> None:
    """A write that comes back the same is replayed from a CUDA graph (`WRITES`): each
    replay lands its own pages, and digests handed out but not yet read when the ring
    of slots comes round are still their own write's."""
    from pdctl.staging.kernels import captured
    from pdctl.staging.kernels.page_write import WRITES

    k, v = random_kv(4, 64 * 16, 8, 128, torch.bfloat16, 11, "cpu")
    kc, vc = [t.cuda() for t in k], [t.cuda() for t in v]
    device_target = [b.cuda() for b in _target(4, 64, 16, 8, 128, torch.bfloat16, "cpu")]
    segments = [(0, 8), (8, 4)]
    replays = WRITES.replays

    heads = KVSlice(2, 4, 16)

    def write(seed: int):  # type: ignore[no-untyped-def]
        pages, dst_pages = random_pages(64, 12, seed), random_pages(64, 12, seed + 1000)
        target = PeerPages(device_target, dst_pages, 2)
        pending = start_slice_write(kc, vc, pages, target, segments, heads)
        expected = slice_digests(k, v, pages, segments, heads)
        return pending, expected, pages, dst_pages

    for seed in range(8):  # read at once: the bytes of each write are checked
        pending, expected, pages, dst_pages = write(seed)
        assert pending.result() == expected, seed
        rows = torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in dst_pages.tolist()])
        src_rows = torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in pages.tolist()])
        sources = [b for pair in zip(k, v, strict=True) for b in pair]
        for landed, source in zip(device_target, sources, strict=True):
            assert torch.equal(as_bits(landed.cpu()[rows, 2:6]), as_bits(source[src_rows, 2:6])), (
                seed
            )
    unread = [write(100 + seed) for seed in range(3 * captured.SLOTS)]  # round the ring thrice
    for index, (pending, expected, _, _) in enumerate(unread):
        assert pending.result() == expected, index
    assert WRITES.replays - replays >= 3 * captured.SLOTS


@pytest.mark.parametrize("segments", [[(0, 5)], [(0, 2), (2, 2), (4, 1)]])
def test_the_launch_rings_decodes_doorbell_with_the_sums_of_its_digests(segments) -> None:
    """With a bell the write's own launch rings it (the Triton path: interpreted on the
    CPU, the box in host memory): the sums finalise to the digests the write gives."""
    import numpy as np

    from pdctl.staging.digest import digests_of_sums
    from pdctl.staging.doorbell import SUMS, BellBox, BellRinger

    device = "cuda" if CUDA else "cpu"
    k, v = random_kv(2, 12 * 4, 4, 16, torch.bfloat16, 3, device)
    pages, dst_pages = random_pages(12, 5, 3), random_pages(12, 5, 4)
    target = _target(2, 12, 4, 2, 16, torch.bfloat16, device)
    with BellBox(2, 64) as box, BellRinger(box.info) as ringer:
        ticket = box.ticket()
        assert ticket is not None
        address = ringer.device_slot(ticket.slot, torch.device(device))
        if address is None:
            address = ringer.slot_address(ticket.slot)
        peer, heads = PeerPages(target, dst_pages, 0), KVSlice(2, 2, 4)
        bell = (address, ticket.seq)
        pending = start_slice_write(k, v, pages, peer, segments, heads, backend="triton", bell=bell)
        assert pending.rung
        digests = [d for part in pending.result() for d in part]
        rung = box.wait(ticket, 5.0)
        assert rung is not None and rung[0] == SUMS and len(rung[1]) == 4 * len(segments)
        words = np.repeat(np.asarray(pending.words, dtype=np.uint64), 4)
        assert digests_of_sums(rung[1], words) == digests


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_writes_of_other_lengths_in_one_bucket_replay_one_graph() -> None:
    """Writes of 9 to 16 pages share a graph (`write_slots.Bucket`): each replay lands its own
    pages and digests, the padding never read or written."""
    from pdctl.staging.kernels.page_write import WRITES

    k, v = random_kv(4, 64 * 16, 8, 128, torch.bfloat16, 13, "cpu")
    kc, vc = [t.cuda() for t in k], [t.cuda() for t in v]
    fresh = _target(4, 64, 16, 8, 128, torch.bfloat16, "cpu")
    device_target = [b.cuda() for b in fresh]
    captures, replays = WRITES.captures, WRITES.replays
    for step, count in enumerate([9, 12, 16, 11, 13, 10, 15, 14, 9, 16]):
        pages, dst_pages = random_pages(64, count, step), random_pages(64, count, step + 500)
        segments = [(0, count)] if step % 2 else [(0, 8), (8, count - 8)]  # segments of 8
        target = PeerPages(device_target, dst_pages, 2)
        pending = start_slice_write(kc, vc, pages, target, segments, KVSlice(2, 4, 16))
        expected = slice_digests(k, v, pages, segments, KVSlice(2, 4, 16))
        assert pending.result() == expected, (step, count)
        rows = torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in dst_pages.tolist()])
        src_rows = torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in pages.tolist()])
        sources = [b for pair in zip(k, v, strict=True) for b in pair]
        for landed, source in zip(device_target, sources, strict=True):
            assert torch.equal(as_bits(landed.cpu()[rows, 2:6]), as_bits(source[src_rows, 2:6]))
    assert WRITES.captures - captures <= 2  # one bucket per segment count
    assert WRITES.replays - replays >= 4


def test_a_buckets_tables_are_the_writes_own_padded_end_to_end() -> None:
    """`Bucket.tables`: the segment table and both page lists zero-padded to the
    bucket's (an empty segment, page 0), the ring as it is, each part from an even
    offset; the spans say where each lies."""
    from pdctl.staging.kernels.digests import segment_table
    from pdctl.staging.kernels.write_slots import Bucket

    segments = [(0, 5), (5, 4), (9, 2)]
    pages, dst_pages = np.arange(11, dtype=np.int64) + 1, np.arange(11, dtype=np.int64) + 40
    ring = np.asarray([7, 3, 12], dtype=np.int64)
    table = segment_table(segments, 16)
    bucket, joined, spans = Bucket.tables(segments, 4, [table, pages, dst_pages, ring])
    assert bucket == Bucket(4, 5, 16, 4) and bucket.sums == 16
    assert [start % 2 for start, _ in spans] == [0] * 4
    assert [end - start for start, end in spans] == [8, 16, 16, 3]
    padded = [*segments, (0, 0)]
    expected = [segment_table(padded, 16), [*pages, *[0] * 5], [*dst_pages, *[0] * 5], ring]
    for (start, end), part in zip(spans, expected, strict=True):
        assert joined[start:end].tolist() == list(part)
