"""The fixed layout of a decode batch (what a CUDA graph reads), on the CPU.

Run eagerly through the same model code, it must give bitwise the logits of the
normal `ForwardBatch` path, with the torch attention and with the Triton kernel
(TRITON_INTERPRET=1), for several batches and buckets, and write the same KV but for
the scratch row, which the KV pool never hands out.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.model import attention, triton_attention
from pdctl.serve.model.batch import Piece
from pdctl.serve.model.decode_batch import DecodeLayout, decode_refusal
from tests.serve.decode_twins import CAPACITY, CPU, LENGTHS, fixed_logits, make_twins

BATCHES = [([0], [1, 2, 16]), ([2, 0, 5], [3, 4, 8]), ([3, 1, 4, 6, 7], [8]), ([8], [1])]


@pytest.mark.parametrize("implementation", ["torch", "triton"])
def test_the_fixed_layout_gives_the_eager_logits(implementation, monkeypatch) -> None:
    twins = make_twins()
    if implementation == "triton":  # the kernel interpreted on the CPU: fewer cases
        monkeypatch.setattr(attention, "paged_attention", triton_attention.paged_attention)
    scratch = twins.pools[1].scratch_row
    batches = BATCHES if implementation == "torch" else [BATCHES[1]]
    for sequences, buckets in batches:
        for step in (0, 1):  # a second step: each piece one key longer
            pieces = twins.pieces(sequences, step)
            want = twins.eager.forward(pieces)
            for size in buckets:
                got = fixed_logits(twins, DecodeLayout(size, CAPACITY, scratch, CPU), pieces)
                assert torch.equal(got, want), (sequences, size, step)
            twins.assert_same_kv()


def test_a_layout_reused_for_other_batches_keeps_giving_the_eager_logits() -> None:
    """Stale rows of a larger batch before never reach a smaller one's numbers."""
    twins = make_twins()
    layout = DecodeLayout(8, CAPACITY, twins.pools[1].scratch_row, CPU)
    for sequences in ([0, 1, 2, 3, 4, 5, 6, 7], [8, 2], [3, 1, 4, 6, 0], [7]):
        pieces = twins.pieces(sequences)
        assert torch.equal(fixed_logits(twins, layout, pieces), twins.eager.forward(pieces))
    twins.assert_same_kv()


def test_the_layout_pads_to_the_scratch_row() -> None:
    twins = make_twins()
    scratch = twins.pools[1].scratch_row
    layout = DecodeLayout(4, CAPACITY, scratch, CPU)
    pieces = twins.pieces([2, 0])
    layout.fill(pieces)
    batch, keys = layout.batch, layout.batch.keys
    total = (LENGTHS[2] + 1) + (LENGTHS[0] + 1)
    assert batch.positions.tolist() == [LENGTHS[2], LENGTHS[0], 0, 0]
    assert keys.lengths.tolist() == [LENGTHS[2] + 1, LENGTHS[0] + 1, 1, 1]
    assert keys.key_offsets.tolist() == [0, LENGTHS[2] + 1, total, total]
    assert keys.tile_positions.tolist() == [0, 32, 0, 0]
    assert batch.new_rows.tolist() == [int(p.rows[p.start]) for p in pieces] + [scratch] * 2
    assert int(keys.rows[total]) == scratch
    assert torch.equal(keys.rows[: LENGTHS[2] + 1], pieces[0].rows)
    assert keys.num_tiles == 4 and keys.max_keys == CAPACITY and keys.rows.numel() == 4 * 320 + 1
    assert batch.tokens.tolist()[2:] == [0, 0]


def test_the_layout_refuses_what_it_cannot_hold() -> None:
    twins = make_twins()
    layout = DecodeLayout(2, CAPACITY, twins.pools[1].scratch_row, CPU)
    with pytest.raises(ValueError, match="3 pieces for a decode layout of 2"):
        layout.fill(twins.pieces([0, 1, 2]))
    prefill = Piece(torch.tensor([1, 2]), 0, torch.arange(2))
    with pytest.raises(ValueError, match="more than one new token"):
        layout.fill([prefill])
    with pytest.raises(ValueError, match="size and capacity"):
        DecodeLayout(0, CAPACITY, 0, CPU)
    long = Piece(torch.tensor([1]), CAPACITY, torch.arange(CAPACITY + 1))
    assert decode_refusal([long], CAPACITY) == "a context past the key table's capacity"
    assert decode_refusal([long], CAPACITY + 1) is None
    embedded = Piece(torch.tensor([1]), 3, torch.arange(4), embeds=((0, torch.zeros(1, 4)),))
    assert decode_refusal([embedded], CAPACITY) == "multimodal embeddings"
    silent = Piece(torch.tensor([1]), 3, torch.arange(4), want_logits=False)
    assert decode_refusal([silent], CAPACITY) == "a piece that wants no logits"
    assert decode_refusal([Piece(torch.tensor([1]), 3, torch.arange(3))], CAPACITY) is not None
    assert decode_refusal([], CAPACITY) == "an empty batch"


def test_the_kv_pool_keeps_its_last_page_as_scratch() -> None:
    pool = KVPool(2, 64, 1, 8, 16, torch.float32, CPU)
    assert pool.scratch_row == 48 and pool.pages.num_pages == 3
    assert pool.pages.allocate(3) == [0, 1, 2] and pool.pages.allocate(1) is None
    with pytest.raises(ValueError, match="less than two"):
        KVPool(2, 16, 1, 8, 16, torch.float32, CPU)
