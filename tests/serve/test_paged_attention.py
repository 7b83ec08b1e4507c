"""Paged attention for a whole batch: the Triton kernel, the CPU's C kernel and the torch
reference.

Each must give a query bitwise the same output whatever else is in the batch, however
its prompt was chunked, after a prefix-cache hit (its prefix's KV in other pool rows,
suffix-only prefill) and as a one-token decode; both must be close to float64
attention and to each other. CPU: the kernel runs with TRITON_INTERPRET=1 (float32
and float16; the interpreter mishandles bfloat16 dots). The model-level tests run the
tiny preset with each implementation.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdctl.serve.engine.kv_pool import KVPool
from pdctl.serve.model import attention, native_attention, ops, triton_attention
from pdctl.serve.model.batch import ForwardBatch, Piece
from pdctl.serve.model.runner import ModelRunner
from pdctl.serve.model.weights import build_rank_weights, preset_config, preset_source

Attention = Callable[..., torch.Tensor]
IMPLEMENTATIONS = {
    "torch": attention.paged_attention_reference,
    "triton": triton_attention.paged_attention,
    "native": native_attention.paged_attention,  # the CPU's C kernel: float32 only
}
POOL = 4096
# (query heads, KV heads, head dim): GQA by 2; a group of 3 and a head dim of 24 (padded)
SHAPES = [(4, 2, 32), (6, 2, 24)]


@dataclass
class Pool:
    k: torch.Tensor  # [POOL, kv heads, dim]
    v: torch.Tensor  # [POOL, kv heads, dim]
    free: list[int]

    def take(self, count: int) -> torch.Tensor:
        rows, self.free = self.free[:count], self.free[count:]
        return torch.tensor(rows, dtype=torch.int64)


@dataclass
class Sequence:
    """One sequence's queries and pool rows (its K and V written there)."""

    q: torch.Tensor  # [length, heads, dim]
    rows: torch.Tensor  # [length] pool rows of positions 0..length-1

    def piece(self, start: int, count: int, rows: torch.Tensor | None = None) -> Piece:
        tokens = torch.zeros(count, dtype=torch.int64)  # unused by attention
        return Piece(tokens, start, (self.rows if rows is None else rows)[: start + count])


def make_pool(shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0) -> Pool:
    _, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(POOL, kv_heads, dim, generator=generator).to(dtype)
    order = torch.randperm(POOL, generator=generator).tolist()  # scattered, like pages
    return Pool(k, v, order)


def make_sequence(pool: Pool, shape: tuple[int, int, int], length: int, seed: int) -> Sequence:
    heads, _, dim = shape
    generator = torch.Generator().manual_seed(1000 + seed)
    q = torch.randn(length, heads, dim, generator=generator).to(pool.k.dtype)
    return Sequence(q, pool.take(length))


def run(
    implementation: Attention,
    pool: Pool,
    parts: list[tuple[Sequence, Piece]],
    window: int | None = None,
) -> list[torch.Tensor]:
    """One forward's attention over `parts`; each piece's output rows [n, heads, dim]."""
    pieces = [piece for _, piece in parts]
    queries = [seq.q[p.start : p.start + p.tokens.numel()] for seq, p in parts]
    q = ops.pad_rows(torch.cat(queries))  # [T padded, heads, dim]
    batch = ForwardBatch.build(pieces, torch.device("cpu"))
    dim = q.shape[-1]
    out = implementation(q, pool.k, pool.v, batch.keys, dim**-0.5, window)
    assert out.shape == q.shape
    assert torch.equal(out[batch.num_tokens :], torch.zeros_like(out[batch.num_tokens :]))
    sizes = [p.tokens.numel() for p in pieces]
    return list(torch.split(out[: batch.num_tokens], sizes))


def exact(
    pool: Pool, seq: Sequence, start: int, count: int, window: int | None = None
) -> torch.Tensor:
    """Float64 causal attention of positions start..start+count-1 (keys in the window)."""
    heads = seq.q.shape[1]
    group = heads // pool.k.shape[1]
    rows = seq.rows[: start + count]
    k = pool.k[rows].double().repeat_interleave(group, dim=1)
    v = pool.v[rows].double().repeat_interleave(group, dim=1)
    q = seq.q[start : start + count].double()
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    positions = torch.arange(start, start + count)[:, None]
    key_positions = torch.arange(rows.numel())[None, :]
    scores = scores.masked_fill(key_positions > positions, float("-inf"))
    if window is not None:
        scores = scores.masked_fill(key_positions <= positions - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


parametrized = pytest.mark.parametrize(
    ("name", "shape", "dtype"),
    [
        pytest.param(name, shape, dtype, id=f"{name}-{'x'.join(map(str, shape))}-{dtype}")
        for name in IMPLEMENTATIONS
        for shape in SHAPES
        for dtype in (torch.float32, torch.float16)
        if name != "native" or dtype == torch.float32
    ],
)


@parametrized
def test_a_query_does_not_depend_on_the_batch(name, shape, dtype) -> None:
    implementation = IMPLEMENTATIONS[name]
    pool = make_pool(shape, dtype)
    a, b, c, d = (make_sequence(pool, shape, n, i) for i, n in enumerate((150, 300, 77, 20)))
    (alone,) = run(implementation, pool, [(a, a.piece(0, 150))])
    mixes = [
        [(b, b.piece(299, 1)), (a, a.piece(0, 150)), (c, c.piece(13, 64))],
        [(c, c.piece(0, 77)), (d, d.piece(19, 1)), (b, b.piece(64, 200)), (a, a.piece(0, 150))],
        [(a, a.piece(0, 150)), (d, d.piece(0, 20))],
    ]
    for mix in mixes:
        outputs = run(implementation, pool, mix)
        index = next(i for i, (seq, _) in enumerate(mix) if seq is a)
        assert torch.equal(outputs[index], alone)


@parametrized
def test_chunked_prefill_gives_the_whole_prompts_output(name, shape, dtype) -> None:
    implementation = IMPLEMENTATIONS[name]
    pool = make_pool(shape, dtype)
    seq = make_sequence(pool, shape, 150, 0)
    (whole,) = run(implementation, pool, [(seq, seq.piece(0, 150))])
    for bounds in ([0, 37, 101, 150], [0, 64, 128, 150], [0, 1, 2, 150], [0, 149, 150]):
        chunks = [
            run(implementation, pool, [(seq, seq.piece(lo, hi - lo))])[0]
            for lo, hi in itertools.pairwise(bounds)
        ]
        assert torch.equal(torch.cat(chunks), whole), bounds


@parametrized
def test_a_prefix_hit_gives_the_whole_prompts_output(name, shape, dtype) -> None:
    """The prefix's KV in other pool rows (cached pages), only the suffix computed."""
    implementation = IMPLEMENTATIONS[name]
    pool = make_pool(shape, dtype)
    seq = make_sequence(pool, shape, 150, 0)
    (whole,) = run(implementation, pool, [(seq, seq.piece(0, 150))])
    for cached in (16, 64, 96):
        cached_rows = pool.take(cached)
        pool.k[cached_rows] = pool.k[seq.rows[:cached]]
        pool.v[cached_rows] = pool.v[seq.rows[:cached]]
        rows = torch.cat([cached_rows, seq.rows[cached:]])
        other = make_sequence(pool, shape, 40, 7)
        parts = [(other, other.piece(0, 40)), (seq, seq.piece(cached, 150 - cached, rows))]
        suffix = run(implementation, pool, parts)[1]
        assert torch.equal(suffix, whole[cached:]), cached


@parametrized
def test_a_decode_step_gives_that_querys_prefill_output(name, shape, dtype) -> None:
    implementation = IMPLEMENTATIONS[name]
    pool = make_pool(shape, dtype)
    seq = make_sequence(pool, shape, 150, 0)
    other = make_sequence(pool, shape, 90, 1)
    (whole,) = run(implementation, pool, [(seq, seq.piece(0, 150))])
    for position in (0, 15, 16, 63, 64, 65, 149):
        parts = [(other, other.piece(89, 1)), (seq, seq.piece(position, 1))]
        decoded = run(implementation, pool, parts)[1]
        assert torch.equal(decoded[0], whole[position]), position


@parametrized
def test_close_to_float64_attention(name, shape, dtype) -> None:
    implementation = IMPLEMENTATIONS[name]
    pool = make_pool(shape, dtype)
    seqs = [make_sequence(pool, shape, n, i) for i, n in enumerate((150, 1, 70, 200))]
    spans = [(0, 150), (0, 1), (30, 40), (199, 1)]
    parts = [(s, s.piece(lo, n)) for s, (lo, n) in zip(seqs, spans, strict=True)]
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    outputs = run(implementation, pool, parts)
    for out, seq, (lo, n) in zip(outputs, seqs, spans, strict=True):
        torch.testing.assert_close(out.double(), exact(pool, seq, lo, n), atol=tolerance, rtol=0)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("window", [1, 20, 64, 100])
def test_a_sliding_window_hides_older_keys_and_stays_invariant(name, window) -> None:
    """Close to float64 attention over the window; batch, chunk, prefix-hit and decode
    invariant as without one (windows inside a key block, one block, across blocks)."""
    implementation, shape, dtype = IMPLEMENTATIONS[name], SHAPES[1], torch.float32
    pool = make_pool(shape, dtype, seed=window)
    seq, other = make_sequence(pool, shape, 200, 0), make_sequence(pool, shape, 90, 1)
    (whole,) = run(implementation, pool, [(seq, seq.piece(0, 200))], window)
    torch.testing.assert_close(whole.double(), exact(pool, seq, 0, 200, window), atol=1e-5, rtol=0)
    (unwindowed,) = run(implementation, pool, [(seq, seq.piece(0, 200))])
    assert not torch.allclose(whole[window + 1 :], unwindowed[window + 1 :], atol=1e-3)
    assert torch.equal(whole[:window], unwindowed[:window])  # nothing hidden yet
    mixed = [(other, other.piece(0, 90)), (seq, seq.piece(0, 200))]
    assert torch.equal(run(implementation, pool, mixed, window)[1], whole)
    chunks = [run(implementation, pool, [(seq, seq.piece(lo, hi - lo))], window)[0]
              for lo, hi in itertools.pairwise([0, 37, 130, 199, 200])]  # fmt: skip
    assert torch.equal(torch.cat(chunks), whole)
    cached_rows = pool.take(64)
    pool.k[cached_rows], pool.v[cached_rows] = pool.k[seq.rows[:64]], pool.v[seq.rows[:64]]
    rows = torch.cat([cached_rows, seq.rows[64:]])
    suffix = run(implementation, pool, [(seq, seq.piece(64, 136, rows))], window)[0]
    assert torch.equal(suffix, whole[64:])
    for position in (0, window - 1, window, 65, 128, 199):
        parts = [(other, other.piece(89, 1)), (seq, seq.piece(min(position, 199), 1))]
        decoded = run(implementation, pool, parts, window)[1]
        assert torch.equal(decoded[0], whole[min(position, 199)]), position


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_is_close_to_its_torch_reference(dtype) -> None:
    shape = SHAPES[0]
    pool = make_pool(shape, dtype, seed=3)
    seqs = [make_sequence(pool, shape, n, i) for i, n in enumerate((333, 64, 5))]
    parts = [(seqs[0], seqs[0].piece(100, 233)), (seqs[1], seqs[1].piece(63, 1))]
    parts.append((seqs[2], seqs[2].piece(0, 5)))
    kernel = run(triton_attention.paged_attention, pool, parts)
    reference = run(attention.paged_attention_reference, pool, parts)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    for got, want in zip(kernel, reference, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=0)


def test_the_kernel_refuses_what_it_cannot_compute() -> None:
    pool = make_pool(SHAPES[0], torch.float32)
    seq = make_sequence(pool, SHAPES[0], 20, 0)
    keys = ForwardBatch.build([seq.piece(0, 20)], torch.device("cpu")).keys
    q = ops.pad_rows(seq.q)
    with pytest.raises(ValueError, match="do not group"):
        triton_attention.paged_attention(q[:, :3], pool.k, pool.v, keys, 1.0)
    with pytest.raises(ValueError, match="rows for 20 queries"):
        triton_attention.paged_attention(q[:8], pool.k, pool.v, keys, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        triton_attention.paged_attention(q, pool.k, pool.v[:, :1], keys, 1.0)
    with pytest.raises(ValueError, match="contiguous head dimension"):
        triton_attention.paged_attention(q[..., ::2], pool.k[..., ::2], pool.v[..., ::2], keys, 1.0)
    with pytest.raises(ValueError, match="pool rows"):
        ForwardBatch.build([seq.piece(0, 20, seq.rows[:10])], torch.device("cpu"))
    with pytest.raises(ValueError, match="at least one piece"):
        ForwardBatch.build([], torch.device("cpu"))


def test_deterministic_accelerators_take_the_kernel(monkeypatch) -> None:
    calls = []

    def kernel(*args: object) -> torch.Tensor:
        calls.append(args)
        return torch.zeros(1)

    monkeypatch.setattr(triton_attention, "paged_attention", kernel)
    pool = make_pool(SHAPES[0], torch.float32)
    seq = make_sequence(pool, SHAPES[0], 20, 0)
    keys = ForwardBatch.build([seq.piece(0, 20)], torch.device("cpu")).keys
    q = ops.pad_rows(seq.q)
    attention.paged_attention(q, pool.k, pool.v, keys, 1.0)
    assert calls == []  # the CPU takes the C kernel or the torch path
    monkeypatch.setattr(ops, "triton_available", lambda device_type: True)
    attention.paged_attention(q, pool.k, pool.v, keys, 1.0)
    assert len(calls) == 1


# -- the model: the tiny preset, each implementation ---------------------------------
CONFIG = preset_config("tiny")
PROMPT = [(37 * i) % 500 + 3 for i in range(150)]


def model_logits(name: str, monkeypatch, batches: list[list[tuple[int, int, int]]]):  # type: ignore[no-untyped-def]
    """Run `batches` of (sequence, start, count) pieces; the logits of each batch's last piece.

    Sequence 0 is PROMPT in pool rows 0.., sequence 1 PROMPT's first 64 tokens' cached
    copy then the rest (a prefix hit), sequence 2 another prompt.
    """
    monkeypatch.setattr(attention, "paged_attention", IMPLEMENTATIONS[name])
    weights = build_rank_weights(CONFIG, preset_source(0), 1, 0, torch.float32, torch.device("cpu"))
    kv = KVPool(CONFIG.shape.num_layers, 1024, weights.kv_heads, CONFIG.shape.head_dim, 16,
                torch.float32, torch.device("cpu"))  # fmt: skip
    runner = ModelRunner(weights, kv, torch.device("cpu"))
    other = [(11 * i) % 500 + 1 for i in range(90)]
    prompts = [PROMPT, PROMPT, other]
    rows = [torch.arange(0, 150), torch.cat([torch.arange(0, 64), torch.arange(200, 286)])]
    rows.append(torch.arange(400, 490))
    results = []
    for batch in batches:
        pieces = [
            Piece(torch.tensor(prompts[s][lo : lo + n]), lo, rows[s][: lo + n])
            for s, lo, n in batch
        ]
        logits = runner.forward(pieces)
        assert logits is not None
        results.append(logits[-1])
    return results


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_the_model_is_invariant_with_each_implementation(name, monkeypatch) -> None:
    (whole,) = model_logits(name, monkeypatch, [[(0, 0, 150)]])
    chunked = model_logits(name, monkeypatch, [[(0, 0, 40)], [(0, 40, 70)], [(0, 110, 40)]])
    hit = model_logits(name, monkeypatch, [[(0, 0, 64)], [(2, 0, 90), (1, 64, 86)]])
    decode = model_logits(name, monkeypatch, [[(2, 0, 90), (0, 0, 149)], [(2, 89, 1), (0, 149, 1)]])
    assert torch.equal(chunked[-1], whole)
    assert torch.equal(hit[-1], whole)
    assert torch.equal(decode[-1], whole)


@pytest.mark.parametrize("window", [None, 100])
def test_torch_tile_buckets_skip_future_blocks_bitwise(monkeypatch, window) -> None:
    """A prompt of 700 from position 0 with a decode piece beside it: its tiles go in
    several buckets, each up to the last key block one of its tiles may see, and give
    bitwise what one bucket over every block gives."""
    shape = SHAPES[0]
    pool = make_pool(shape, torch.float32, seed=3)
    long, short = make_sequence(pool, shape, 700, 1), make_sequence(pool, shape, 90, 2)
    parts = [(long, long.piece(0, 700)), (short, short.piece(89, 1))]
    batch = ForwardBatch.build([p for _, p in parts], torch.device("cpu"))
    buckets = attention.tile_buckets(batch.keys)
    assert len(buckets) > 1
    covered = []
    for tiles, blocks in buckets:
        assert tiles is not None
        for tile in tiles.tolist():  # no tile computes fewer blocks than it may see
            last = min(int(batch.keys.tile_positions[tile]) + 15, 699 if tile < 44 else 89)
            assert blocks >= last // attention.KEY_BLOCK + 1
            covered.append(tile)
    assert sorted(covered) == list(range(batch.keys.num_tiles))
    assert buckets[-1][1] < buckets[0][1]  # the early tiles stop short of the last block
    split = run(attention.paged_attention_reference, pool, parts, window)
    monkeypatch.setattr(attention, "BUCKET_COST", 10**9)  # one bucket, every block
    assert len(attention.tile_buckets(batch.keys)) == 1
    whole = run(attention.paged_attention_reference, pool, parts, window)
    for a, b in zip(split, whole, strict=True):
        assert torch.equal(a, b)
    assert torch.allclose(split[0].double(), exact(pool, long, 0, 700, window), atol=1e-4)
