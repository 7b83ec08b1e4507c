"""The CPU's paged attention in C (`native_attention`): which calls it serves, that it
agrees with the torch path, that a row does not depend on the threads, and that a key
table it cannot trust is refused. Invariance (batch, chunks, prefix hit, decode, window)
is in test_paged_attention.py, with the other implementations."""

from __future__ import annotations

import pytest
import torch

from pdctl.serve.model import attention, native_attention, ops
from pdctl.serve.model.batch import ForwardBatch, KeyTable, Piece

pytestmark = pytest.mark.skipif(
    not native_attention.available()[0], reason=f"no C kernel: {native_attention.available()[1]}"
)


def batch(
    shape: tuple[int, int, int], spans: list[tuple[int, int]], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeyTable]:
    """q, K, V and the key table of pieces (start, count) over a shuffled pool."""
    heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(seed)
    pool = 1024
    k = torch.randn(pool, kv_heads, dim, generator=generator)  # [pool, Hkv, D]
    v = torch.randn(pool, kv_heads, dim, generator=generator)
    order = torch.randperm(pool, generator=generator)
    pieces, used = [], 0
    for start, count in spans:
        pieces.append(
            Piece(torch.zeros(count, dtype=torch.int64), start, order[used : used + start + count])
        )
        used += start + count
    table = ForwardBatch.build(pieces, torch.device("cpu")).keys
    q = torch.randn(ops.round_up(sum(c for _, c in spans), 16), heads, dim, generator=generator)
    return q, k, v, table


SPANS = [(0, 150), (99, 1), (10, 37), (255, 1), (0, 1)]


@pytest.mark.parametrize("shape", [(8, 4, 32), (4, 4, 64), (12, 2, 40), (8, 1, 128), (3, 3, 5)])
@pytest.mark.parametrize("window", [None, 1, 20, 100])
def test_close_to_the_torch_path(shape, window) -> None:
    q, k, v, table = batch(shape, SPANS, seed=len(shape) + (window or 0))
    got = native_attention.paged_attention(q, k, v, table, 0.3, window)
    want = attention.paged_attention_reference(q, k, v, table, 0.3, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)  # rounding apart
    assert torch.equal(got[table.num_queries :], torch.zeros_like(got[table.num_queries :]))


def test_rows_do_not_depend_on_the_threads(monkeypatch) -> None:
    q, k, v, table = batch((8, 4, 32), SPANS)
    outputs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        outputs.append(native_attention.paged_attention(q, k, v, table, 0.3))
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


def test_large_scores_and_a_single_key_stay_finite() -> None:
    """Scores far below the peak (weights of e^-87 or less) and a query with one key."""
    q, k, v, table = batch((4, 2, 16), [(0, 40), (0, 1)])
    got = native_attention.paged_attention(q * 400, k, v, table, 1.0)
    want = attention.paged_attention_reference(q * 400, k, v, table, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_cpu_takes_it_for_float32_only(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(native_attention, "paged_attention", lambda *a: calls.append(a) or a[0])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, k, v, table = batch((4, 2, 16), [(0, 20)])
        attention.paged_attention(q.to(dtype), k.to(dtype), v.to(dtype), table, 1.0)
    assert len(calls) == 1 and calls[0][0].dtype == torch.float32


def test_a_table_it_cannot_trust_is_refused() -> None:
    q, k, v, table = batch((4, 2, 16), [(0, 20), (5, 3)])
    with pytest.raises(ValueError, match="outside the pool"):
        native_attention.paged_attention(q, k[:100], v[:100], table, 1.0)
    with pytest.raises(ValueError, match="queries in the key table"):
        native_attention.paged_attention(q[:16], k, v, table, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        native_attention.paged_attention(q[:, :3], k, v, table, 1.0)
    with pytest.raises(ValueError, match="contiguous float32"):
        native_attention.paged_attention(q, k.double(), v.double(), table, 1.0)


def test_turned_off_it_says_so(monkeypatch) -> None:
    monkeypatch.setattr(native_attention, "_off", [])
    native_attention.switch_off()
    try:
        assert native_attention.available() == (False, "turned off (--no-native-attention)")
        q, k, _, _ = batch((4, 2, 16), [(0, 20)])
        assert not native_attention.serves(q, k)
    finally:
        monkeypatch.undo()
        native_attention._kernel.cache_clear()
    assert native_attention.available()[0]
