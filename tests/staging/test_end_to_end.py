"""The whole staging path in one process: prefill pools -> gather -> ring -> scatter -> decode.

Every prefill/decode TP pair, a ring small enough to wrap many times, requests cut
into segments, digests checked, and every decode pool ends up equal to the heads
it should hold while the rings drain to empty.
"""

from __future__ import annotations

import pytest
import torch

from pdctl.staging.buffer import init_staging_allocator
from pdctl.staging.digest import block_digests
from pdctl.staging.handler import DecodeStagingHandler
from pdctl.staging.kernels import gather_slice
from pdctl.staging.layout import StagingLayout, head_slices, plan_segments, rank_heads
from tests.staging.kv_factory import as_bits, random_kv, random_pages

HEADS, DIM, LAYERS, PAGE, POOL_PAGES = 4, 8, 3, 4, 48


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (1, 4), (4, 2), (2, 2), (1, 8), (8, 2)]
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_requests_move_through_a_wrapping_ring(prefill_tp, decode_tp, backend) -> None:
    pool_tokens = POOL_PAGES * PAGE
    full_k, full_v = random_kv(
        LAYERS, pool_tokens, HEADS, DIM, torch.bfloat16, seed=prefill_tp * 10 + decode_tp
    )

    def shard(tp: int, rank: int, source: list[torch.Tensor]) -> list[torch.Tensor]:
        heads = rank_heads(HEADS, tp, rank)
        return [t[:, heads.start : heads.stop].contiguous() for t in source]

    prefill = [
        (shard(prefill_tp, r, full_k), shard(prefill_tp, r, full_v)) for r in range(prefill_tp)
    ]
    handlers = []
    for rank in range(decode_tp):
        heads = len(rank_heads(HEADS, decode_tp, rank))
        k = [torch.zeros(pool_tokens, heads, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
        v = [torch.zeros_like(t) for t in k]
        layout = StagingLayout(LAYERS, DIM, 2, head_slices(HEADS, prefill_tp, decode_tp, rank))
        ring = init_staging_allocator(3 * layout.region_bytes(2 * PAGE), device_type="cpu")
        handlers.append(
            DecodeStagingHandler(k, v, page_size=PAGE, ring=ring, layout=layout, backend=backend)
        )

    gather_buffer = torch.empty(1 << 20, dtype=torch.uint8)
    expected_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    for request in range(6):
        num_pages = 1 + request * 2
        src_pages = random_pages(POOL_PAGES, num_pages, seed=request)
        dst_pages = random_pages(POOL_PAGES, num_pages, seed=100 + request)
        for handler in handlers:
            handler.open_room(request, dst_pages, None)
            segments = plan_segments(
                num_pages,
                PAGE,
                handler.layout.bytes_per_token(),
                2 * PAGE * handler.layout.bytes_per_token(),
            )
            for segment in segments:
                region = handler.assign_region(request, segment)
                assert region is not None and region.writable(handler.ring.allocator.watermark)
                pages = src_pages[segment.page_start : segment.page_start + segment.num_pages]
                tokens = segment.num_tokens(PAGE)
                sent = []
                for writer, piece in enumerate(handler.layout.slices):  # each prefill rank's write
                    pk, pv = prefill[piece.prefill_rank]
                    n = gather_slice(pk, pv, pages, gather_buffer, piece.source(PAGE), backend)
                    sent.append(block_digests(gather_buffer[:n], LAYERS))
                    start = handler.layout.block_offset(writer, tokens)
                    handler.ring.view(region)[start : start + n].copy_(
                        gather_buffer[:n]
                    )  # the transport
                assert handler.check_digests(region, segment, sent) is None
                handler.scatter(request, region, segment)
                handler.reap(request)
            handler.close_room(request)
        src_rows = torch.tensor([int(p) * PAGE + i for p in src_pages for i in range(PAGE)])
        dst_rows = torch.tensor([int(p) * PAGE + i for p in dst_pages for i in range(PAGE)])
        expected_rows.append((src_rows, dst_rows))

    # Later requests may reuse pages: check the last writer of every destination row.
    final: dict[int, int] = {}
    for src_rows, dst_rows in expected_rows:
        final.update(zip(dst_rows.tolist(), src_rows.tolist(), strict=True))
    dst = torch.tensor(list(final))
    src = torch.tensor(list(final.values()))
    for rank, handler in enumerate(handlers):
        heads = rank_heads(HEADS, decode_tp, rank)
        for layer in range(LAYERS):
            assert torch.equal(
                as_bits(handler.k_buffers[layer])[dst],
                as_bits(full_k[layer])[src, heads.start : heads.stop],
            )
            assert torch.equal(
                as_bits(handler.v_buffers[layer])[dst],
                as_bits(full_v[layer])[src, heads.start : heads.stop],
            )
        allocator = handler.ring.allocator
        assert allocator.is_empty and not handler.rooms
        assert allocator.watermark.round >= 2  # the ring wrapped
