"""The engine's fixed-order Triton product (the deterministic default on CUDA and XPU).

CPU: TRITON_INTERPRET=1 (float32 and float16; the interpreter mishandles bfloat16
dots). GPU-marked: bfloat16 rows bit-identical across M and TP column splits.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdctl.serve.model import triton_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [(16, 64, 16), (40, 200, 130), (7, 704, 48)])
def test_matches_torch_and_rows_do_not_depend_on_the_batch(dtype, m, k, n) -> None:
    generator = torch.Generator().manual_seed(m + k + n)
    a = torch.randn(m + 32, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    whole = triton_matmul.matmul(a, b)
    exact = a.double() @ b.double()
    assert ((whole.double() - exact).norm() / exact.norm()).item() < 2e-3
    assert torch.equal(triton_matmul.matmul(a[:m], b), whole[:m])
    assert torch.equal(triton_matmul.matmul(a, b[:, : n // 2 + 1]), whole[:, : n // 2 + 1])


def test_batched_and_strided_operands() -> None:
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(3, 20, 64, generator=generator)
    b = torch.randn(3, 50, 64, generator=generator).transpose(1, 2)  # not contiguous
    c = triton_matmul.matmul(a, b)
    assert c.shape == (3, 20, 50)
    assert torch.allclose(c, torch.bmm(a, b), rtol=1e-5, atol=1e-5)


def test_bad_operands_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="do not chain"):
        triton_matmul.matmul(torch.zeros(4, 8), torch.zeros(9, 4))
    with pytest.raises(ValueError, match="operands differ"):
        triton_matmul.matmul(torch.zeros(4, 8), torch.zeros(8, 4, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_bfloat16_rows_are_bit_identical_across_batch_and_tp_split() -> None:
    device = torch.device("cuda", 0)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(2048, 2048, generator=generator, device=device).to(torch.bfloat16)
    w = torch.randn(2048, 4096, generator=generator, device=device).to(torch.bfloat16)
    first = triton_matmul.matmul(a[:16], w)
    for m in (32, 64, 256, 2048):
        assert torch.equal(triton_matmul.matmul(a[:m], w)[:16], first)
    half = triton_matmul.matmul(a[:16], w[:, :2048].contiguous())
    assert torch.equal(half, first[:, :2048])


def test_one_batched_launch_reduces_each_chunk_exactly_as_its_own_launch() -> None:
    """ops.row_parallel_matmul runs every reduction chunk in one launch on accelerators:
    a strided [chunks, M, K_chunk] view of the activations against the stacked chunks
    must give each chunk's product bit for bit."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 8 * 24, generator=generator).to(torch.float16)  # 8 chunks of 24
    weights = torch.randn(8, 24, 48, generator=generator).to(torch.float16)
    batched = triton_matmul.matmul(x.reshape(32, 8, 24).transpose(0, 1), weights)
    for chunk in range(8):
        alone = triton_matmul.matmul(x[:, chunk * 24 : (chunk + 1) * 24], weights[chunk])
        assert torch.equal(batched[chunk], alone)
