"""Batch-invariant primitives: a token's result never depends on what else is computed.

Why results could otherwise change with the batch (measured on this torch/MKL):
- `mm` picks different kernels by shape: M == 1 or N == 1 take a matrix-vector
  path with another summation order, and with several threads large M splits the
  reduction. Every product here runs single-threaded (the server sets one thread)
  with M and N padded to multiples of TILE, where each output element's value
  depends only on its own row and column (tested: every M, N multiple of 16, any
  row position, any other rows).
- Vectorised transcendental functions treat the tail of a tensor in scalar code.
  Token counts are padded to TILE, so no real element ever lands in a tail.
- Reductions whose length depends on the batch (attention over a growing number
  of keys, `attention.py`) are done in fixed blocks of keys, combined in order:
  trailing blocks (keys a query may not see) add exact zeros.
- On accelerators (CUDA, XPU) the vendor libraries pick kernels by shape, some
  splitting the reduction, and a row reduction's strategy depends on how many rows
  there are (measured on an H200: cuBLAS rounds a prefix-hit's suffix-only prefill
  one bf16 step away from the full prompt's). In deterministic mode (the topology's
  `serving.deterministic`, on by default; the server's `--deterministic`) every
  product and row sum goes through one fixed-configuration Triton kernel
  (`triton_matmul.py`), and the decoder's attention through another
  (`triton_attention.py`): each output element is reduced in the same fixed order
  whatever the batch, chunking or TP split. `--no-deterministic` takes the
  vendor libraries (faster, not invariant) and, on cpu, torch's thread pool.
- Tensor parallelism: a row-parallel product is split into REDUCTION_CHUNKS fixed
  column ranges whatever the TP size; each rank computes its chunks, the partials
  are gathered and summed in chunk order, so TP 1, 2, 4 and 8 add the same numbers
  in the same order.
- Launches: on CUDA and XPU (both serving modes) RMSNorm, RoPE with the KV write,
  SwiGLU and the chunk sums are one Triton launch each (`triton_norm.py`,
  `triton_rope.py`, `triton_pointwise.py`): element-wise or one program per row, so
  batch-invariant; each `*_reference` is its torch path, and the path elsewhere.

Shapes are noted as [tokens, features]; "padded" means rounded up to TILE.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

TILE = 16
REDUCTION_CHUNKS = 8


_mode = {"deterministic": True}  # set once per process, by the server at start-up


def set_deterministic(enabled: bool) -> None:
    """Fixed-order kernels (True, the default) or the vendor fast path, for this process."""
    _mode["deterministic"] = enabled


@functools.lru_cache(maxsize=8)
def triton_available(device_type: str) -> bool:
    """Whether Triton kernels run on this device type (CUDA, XPU) in this process."""
    if device_type not in ("cuda", "xpu"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_mode(device_type: str) -> str:
    """What this process's products run on, as the server reports it."""
    if invariant_kernels(device_type):
        return "triton fixed-order"
    if device_type == "cpu":
        return "torch fixed-order, one thread" if _mode["deterministic"] else "torch, threads"
    return "vendor libraries"


def invariant_kernels(device_type: str) -> bool:
    """Whether products on this device type go through the fixed-order Triton kernel."""
    return _mode["deterministic"] and triton_available(device_type)


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D or batched 3-D operands, batch-invariant on every device."""
    if invariant_kernels(a.device.type):
        from pdctl.serve.model import triton_matmul

        return triton_matmul.matmul(a, b)
    return torch.mm(a, b) if a.dim() == 2 else torch.bmm(a, b)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """x [..., L] -> [..., 1]; on accelerators a product with ones (fixed order)."""
    if not invariant_kernels(x.device.type):
        return x.sum(dim=-1, keepdim=True)
    ones = torch.ones((x.shape[-1], TILE), dtype=x.dtype, device=x.device)
    sums = product(x.reshape(-1, x.shape[-1]), ones)[:, :1]
    return sums.reshape(*x.shape[:-1], 1)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pad_rows(x: torch.Tensor, multiple: int = TILE) -> torch.Tensor:
    rows = x.shape[0]
    target = max(multiple, round_up(rows, multiple))
    if target == rows:
        return x
    padded = x.new_zeros((target, *x.shape[1:]))
    padded[:rows] = x
    return padded


def matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] -> [M, N], batch-invariant.

    `weight_t` must have N padded to TILE already (weights are prepared at load).
    """
    rows = x.shape[0]
    if weight_t.shape[1] % TILE:
        raise ValueError(f"weight has {weight_t.shape[1]} columns, not a multiple of {TILE}")
    return product(pad_rows(x).to(weight_t.dtype), weight_t)[:rows]


AllGather = Callable[[torch.Tensor], torch.Tensor]


def row_parallel_matmul(
    x: torch.Tensor,
    weight_chunks: torch.Tensor,
    gather: AllGather | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_c x_c @ W_c over REDUCTION_CHUNKS column ranges, summed in chunk order.

    `x` [M, K_local] holds this rank's chunks side by side; `weight_chunks` is this
    rank's [local chunks, K_chunk, N] stack. `gather` stacks every rank's partials in
    rank order ([chunks, M, N]); None when there is one rank. `residual` [M, N], when
    given, is added to the sum (in the same launch on accelerators).
    """
    chunks, width, _ = weight_chunks.shape
    # One product for every chunk: the batched kernel reduces each exactly as alone (the
    # Triton kernel by construction; torch's bmm on the CPU gives each chunk's mm bit for
    # bit, tests/serve/test_determinism.py), at a fraction of the host work of a product
    # per chunk.
    rows = x.shape[0]
    padded = pad_rows(x).to(weight_chunks.dtype).reshape(-1, chunks, width)
    partials = product(padded.transpose(0, 1), weight_chunks)[:, :rows]  # [local chunks, M, N]
    if gather is not None:
        partials = gather(partials)  # [REDUCTION_CHUNKS, M, N]
    return add_chunk_sums(partials, residual)


def add_chunk_sums(partials: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """partials [C, M, N] summed in chunk order (+ residual [M, N]): one launch with Triton."""
    if triton_available(partials.device.type):
        from pdctl.serve.model import triton_pointwise

        return triton_pointwise.add_chunk_sums(partials, residual)
    return add_chunk_sums_reference(partials, residual)


def add_chunk_sums_reference(partials: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The torch path of `add_chunk_sums` (same signature): sums in partials' dtype."""
    total = partials[0].clone()
    for chunk in partials[1:]:
        total += chunk
    return total if residual is None else residual + total


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [T, H] -> normalised per row, times weight, in out_dtype (the next product's).

    One Triton launch per norm on accelerators (both serving modes; fixed order per row).
    """
    if triton_available(x.device.type):
        from pdctl.serve.model import triton_norm

        return triton_norm.rms_norm(x, weight, eps, out_dtype)
    return rms_norm_reference(x, weight, eps, out_dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The torch path of `rms_norm` (same signature)."""
    if invariant_kernels(x.device.type):
        variance = row_sums(x.pow(2)) / x.shape[-1]
    else:
        variance = x.pow(2).mean(dim=-1, keepdim=True)
    out = x * torch.rsqrt(variance + eps) * weight
    return out if out_dtype is None else out.to(out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [M, I]: one Triton launch on accelerators."""
    if triton_available(gate.device.type):
        from pdctl.serve.model import triton_pointwise

        return triton_pointwise.silu_mul(gate, up)
    return silu_mul_reference(gate, up)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The torch path of `silu_mul` (same signature)."""
    return torch.nn.functional.silu(gate) * up


def head_norms(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """qkv [T, >= (q_heads + 2 * kv_heads) * D] with every q and k head RMS-normalised by
    q_norm, k_norm [D] (Qwen3, before RoPE): [T, (q_heads + 2 * kv_heads) * D], v as is.

    Each head is one row of `rms_norm`, so a token's result depends on its own row only.
    """
    tokens, dim = qkv.shape[0], q_norm.shape[0]
    q_end, k_end = q_heads * dim, (q_heads + kv_heads) * dim
    q = rms_norm(qkv[:, :q_end].reshape(tokens * q_heads, dim), q_norm, eps, qkv.dtype)
    k = rms_norm(qkv[:, q_end:k_end].reshape(tokens * kv_heads, dim), k_norm, eps, qkv.dtype)
    v = qkv[:, k_end : k_end + kv_heads * dim]
    return torch.cat([q.view(tokens, q_end), k.view(tokens, k_end - q_end), v], dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by per-token cos/sin [T, D/2] (Llama's half-split layout)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    new_rows: torch.Tensor,
) -> torch.Tensor:
    """RoPE of the fused product's q and k, and K and V stored at the pool's `new_rows`.

    qkv [T, >= (q_heads + 2 * kv_heads) * D] holds q | k | v; cos, sin [>= T, D/2]; row t
    of k and v (t < len(new_rows)) goes to pool row new_rows[t] of k_buffer, v_buffer
    [pool, kv_heads, D]. Returns the rotated q [T, q_heads, D] in the cache's dtype (the
    dtype attention multiplies in). One Triton launch on accelerators.
    """
    if triton_available(qkv.device.type):
        from pdctl.serve.model import triton_rope

        return triton_rope.rope_and_cache(qkv, cos, sin, q_heads, k_buffer, v_buffer, new_rows)
    return rope_and_cache_reference(qkv, cos, sin, q_heads, k_buffer, v_buffer, new_rows)


def rope_and_cache_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    new_rows: torch.Tensor,
) -> torch.Tensor:
    """The torch path of `rope_and_cache` (same signature)."""
    tokens, (kv_heads, dim) = qkv.shape[0], k_buffer.shape[1:]
    q_end, k_end = q_heads * dim, (q_heads + kv_heads) * dim
    cos, sin = cos[:tokens], sin[:tokens]
    q = apply_rope(qkv[:, :q_end].reshape(tokens, q_heads, dim), cos, sin)
    k = apply_rope(qkv[:, q_end:k_end].reshape(tokens, kv_heads, dim), cos, sin)
    v = qkv[:, k_end : k_end + kv_heads * dim].reshape(tokens, kv_heads, dim)
    total = new_rows.shape[0]
    k_buffer[new_rows] = k[:total].to(k_buffer.dtype)
    v_buffer[new_rows] = v[:total].to(v_buffer.dtype)
    return q.to(k_buffer.dtype)
