"""The decoder's fused Triton kernels: RMSNorm, RoPE with the KV write, SwiGLU, chunk sums.

Each must give a row bitwise the same output alone as inside any bigger batch (other
row counts, padding rows), be close to its torch reference, and be what `ops` takes on
accelerators. CPU: TRITON_INTERPRET=1, float32, float16 and bfloat16 (the interpreter
rounds float32 -> bfloat16 by truncation, not to nearest, so bfloat16 is only
compared to the reference within a bfloat16 step or two).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdctl.core import RopeSettings
from pdctl.serve.model import ops, rope, triton_norm, triton_pointwise, triton_rope

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


# -- RMSNorm -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200, 5000])  # 5000: more than one block a row
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype, hidden) -> None:
    x = randn(48, hidden, dtype=dtype, seed=hidden)
    weight = 1 + 0.1 * randn(hidden, dtype=torch.float32, seed=1).to(dtype)
    whole = triton_norm.rms_norm(x, weight, 1e-6)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(16, 48)):
        assert torch.equal(triton_norm.rms_norm(x[rows], weight, 1e-6), whole[rows])
    padded = ops.pad_rows(x[:7])  # seven real rows and nine zero rows
    assert torch.equal(triton_norm.rms_norm(padded, weight, 1e-6)[:7], whole[:7])
    want = ops.rms_norm_reference(x.double(), weight.double(), 1e-6)
    assert_close(whole, want, dtype)


def test_rms_norm_writes_the_dtype_asked_for_and_refuses_a_bad_weight() -> None:
    x = randn(4, 32, dtype=torch.float32, seed=0)
    weight = torch.ones(32)
    out = triton_norm.rms_norm(x, weight, 1e-6, torch.float16)
    assert out.dtype == torch.float16
    assert_close(out, ops.rms_norm_reference(x, weight, 1e-6, torch.float16), torch.float16)
    with pytest.raises(ValueError, match="expected"):
        triton_norm.rms_norm(x, torch.ones(31), 1e-6)


# -- RoPE and the KV write ----------------------------------------------------------------
SHAPES = [(4, 2, 24), (16, 8, 128)]  # (q heads, KV heads, head dim)


def rope_case(shape: tuple[int, int, int], dtype: torch.dtype, tokens: int, seed: int):  # type: ignore[no-untyped-def]
    q_heads, kv_heads, dim = shape
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * dim + 16, dtype=dtype, seed=seed)
    cos, sin = rope.rope_tables(dim, 512, RopeSettings())
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(seed))
    return qkv, cos[positions], sin[positions]


def pool(shape: tuple[int, int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((64, shape[1], shape[2]), 7.0, dtype=dtype)  # [pool, kv heads, dim]
    return k, k.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_matches_the_reference_and_writes_only_the_new_rows(dtype, shape) -> None:
    qkv, cos, sin = rope_case(shape, dtype, 20, 3)
    new_rows = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:13]
    (k, v), (k_ref, v_ref) = pool(shape, dtype), pool(shape, dtype)
    q = triton_rope.rope_and_cache(qkv, cos, sin, shape[0], k, v, new_rows)
    q_ref = ops.rope_and_cache_reference(qkv, cos, sin, shape[0], k_ref, v_ref, new_rows)
    assert q.shape == (20, shape[0], shape[2]) and q.dtype == dtype
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(v, v_ref)  # a copy
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[new_rows] = False  # rows 13.. of the batch (padding) are written nowhere
    assert (k[untouched] == 7).all() and (v[untouched] == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_rope_does_not_depend_on_the_batch(dtype) -> None:
    shape = SHAPES[1]
    qkv, cos, sin = rope_case(shape, dtype, 32, 5)
    k, v = pool(shape, dtype)
    whole = triton_rope.rope_and_cache(qkv, cos, sin, shape[0], k, v, torch.arange(32))
    for lo, hi in ((0, 1), (9, 10), (4, 20)):
        k_part, v_part = pool(shape, dtype)
        rows = torch.arange(lo, hi)
        part = triton_rope.rope_and_cache(qkv[lo:hi], cos[lo:hi], sin[lo:hi], shape[0],
                                          k_part, v_part, rows)  # fmt: skip
        assert torch.equal(part, whole[lo:hi])
        assert torch.equal(k_part[lo:hi], k[lo:hi]) and torch.equal(v_part[lo:hi], v[lo:hi])


def test_rope_refuses_what_it_cannot_compute() -> None:
    qkv, cos, sin = rope_case(SHAPES[0], torch.float32, 8, 0)
    k, v = pool(SHAPES[0], torch.float32)
    with pytest.raises(ValueError, match="contiguous columns"):
        triton_rope.rope_and_cache(qkv[:, :100], cos, sin, 4, k, v, torch.arange(8))
    with pytest.raises(ValueError, match="new_rows"):
        triton_rope.rope_and_cache(qkv, cos, sin, 4, k, v, torch.arange(9))
    with pytest.raises(ValueError, match="table"):
        triton_rope.rope_and_cache(qkv, cos[:4], sin[:4], 4, k, v, torch.arange(8))


# -- SwiGLU and the chunk sums ------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rows_do_not_depend_on_the_batch(dtype) -> None:
    gate_up = randn(40, 2 * 1100, dtype=dtype, seed=2)  # two blocks a row, the last partial
    gate, up = gate_up[:, :1100], gate_up[:, 1100:]
    whole = triton_pointwise.silu_mul(gate, up)
    assert torch.equal(triton_pointwise.silu_mul(gate[3:4], up[3:4]), whole[3:4])
    assert torch.equal(triton_pointwise.silu_mul(gate[8:24], up[8:24]), whole[8:24])
    assert_close(whole, ops.silu_mul_reference(gate.double(), up.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_chunk_sums_rows_do_not_depend_on_the_batch(dtype, with_residual) -> None:
    partials = randn(8, 48, 300, dtype=dtype, seed=4)[:, :40]  # a strided view, as the runner's
    residual = randn(40, 300, dtype=dtype, seed=5) if with_residual else None
    whole = triton_pointwise.add_chunk_sums(partials, residual)
    for rows in (slice(0, 1), slice(17, 18), slice(16, 40)):
        part = residual[rows] if residual is not None else None
        assert torch.equal(triton_pointwise.add_chunk_sums(partials[:, rows], part), whole[rows])
    want = ops.add_chunk_sums_reference(
        partials.double(), None if residual is None else residual.double()
    )
    assert_close(whole, want, dtype)


def test_ops_take_the_kernels_on_accelerators(monkeypatch) -> None:
    calls: list[str] = []
    kernels = [(triton_norm, "rms_norm"), (triton_rope, "rope_and_cache")]
    kernels += [(triton_pointwise, "silu_mul"), (triton_pointwise, "add_chunk_sums")]
    for module, name in kernels:
        monkeypatch.setattr(module, name, lambda *args, name=name: calls.append(name))
    x = torch.ones(16, 8)
    qkv, cos, sin = rope_case(SHAPES[0], torch.float32, 4, 0)
    k, v = pool(SHAPES[0], torch.float32)

    def run_all() -> None:
        ops.rms_norm(x, torch.ones(8), 1e-6)
        ops.rope_and_cache(qkv, cos, sin, 4, k, v, torch.arange(4))
        ops.silu_mul(x, x)
        ops.add_chunk_sums(x[None], None)

    run_all()
    assert calls == []  # the CPU takes the torch paths
    monkeypatch.setattr(ops, "triton_available", lambda device_type: True)
    run_all()
    assert calls == ["rms_norm", "rope_and_cache", "silu_mul", "add_chunk_sums"]


# -- the model: the tiny preset with every fused kernel ----------------------------------
def tiny_logits(batches: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
    """Run `batches` of (start, count) pieces of one prompt; each batch's last logits."""
    from pdctl.serve.engine.kv_pool import KVPool
    from pdctl.serve.model.batch import Piece
    from pdctl.serve.model.runner import ModelRunner
    from pdctl.serve.model.weights import build_rank_weights, preset_config, preset_source

    tiny = preset_config("tiny")  # two of its layers: the interpreter runs each kernel slowly
    config = dataclasses.replace(tiny, shape=dataclasses.replace(tiny.shape, num_layers=2))
    weights = build_rank_weights(config, preset_source(0), 1, 0, torch.float32, torch.device("cpu"))
    kv = KVPool(config.shape.num_layers, 256, weights.kv_heads, config.shape.head_dim, 16,
                torch.float32, torch.device("cpu"))  # fmt: skip
    runner = ModelRunner(weights, kv, torch.device("cpu"))
    prompt, rows = [(37 * i) % 500 + 3 for i in range(40)], torch.arange(100, 140)
    results = []
    for batch in batches:
        pieces = [Piece(torch.tensor(prompt[lo : lo + n]), lo, rows[: lo + n]) for lo, n in batch]
        logits = runner.forward(pieces)
        assert logits is not None
        results.append(logits[-1])
    return results


def test_the_model_on_the_fused_kernels_is_invariant_and_close_to_torch(monkeypatch) -> None:
    (torch_whole,) = tiny_logits([[(0, 40)]])
    monkeypatch.setattr(ops, "triton_available", lambda device_type: True)
    monkeypatch.setattr(ops, "invariant_kernels", lambda device_type: False)  # torch products
    (whole,) = tiny_logits([[(0, 40)]])  # three pages of 16
    chunked = tiny_logits([[(0, 17)], [(17, 23)]])
    decode = tiny_logits([[(0, 39)], [(39, 1)]])
    assert torch.equal(chunked[-1], whole)
    assert torch.equal(decode[-1], whole)
    assert torch.allclose(whole, torch_whole, rtol=1e-4, atol=1e-4)
