"""MLA row pack for decode context parallel (DCP).

With DCP, each decode rank keeps every `dcp_size`-th token of an MLA latent KV
buffer ([pool_tokens, 1, latent_dim] per layer). Prefill packs the rows a rank
needs into one contiguous buffer per transfer. The pack kernel is Triton-only: off
CUDA, `init_dcp_pack_buffers` returns no buffers and registers nothing, and the
caller falls back to per-token writes (`per_token_descriptors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pdctl.staging import device as dev
from pdctl.staging.descriptors import as_u64, tensor_ptr
from pdctl.staging.kernels.base import KVColumns, get_backend

Register = Callable[[int, int, str, int | None], None]  # (ptr, nbytes, device_type, gpu_id)


def dcp_supported(device_type: str) -> bool:
    """The pack runs where Triton runs natively, and only there."""
    return device_type.split(":", 1)[0] == "cuda"


def init_dcp_pack_buffers(
    max_rows: int,
    row_bytes: int,
    num_layers: int,
    *,
    device_type: str,
    gpu_id: int | None = None,
    register: Register | None = None,
) -> list[torch.Tensor]:
    """One flat pack buffer of num_layers x max_rows x row_bytes on CUDA; [] elsewhere.

    Registration gets the bare device type ("cuda") and `gpu_id`, as transports
    expect, never a "cuda:N" string.
    """
    if not dcp_supported(device_type):
        return []
    device = dev.resolve_device(device_type, gpu_id)
    pack = allocate_pack(num_layers * max_rows * row_bytes, device)
    if register is not None:
        register(tensor_ptr(pack), pack.numel(), device.type, device.index)
    return [pack]


def allocate_pack(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]


def dcp_rows(num_tokens: int, dcp_size: int, dcp_rank: int) -> np.ndarray:
    """Token positions rank `dcp_rank` holds under interleaved DCP."""
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank {dcp_rank} is outside dcp_size {dcp_size}")
    return np.arange(dcp_rank, num_tokens, dcp_size, dtype=np.int64)


def copy_mla_rows_into_pack(
    kv_buffers: Sequence[torch.Tensor],
    token_rows: torch.Tensor,
    pack: torch.Tensor,
    *,
    backend: str = "triton",
) -> torch.Tensor:
    """Pack rows tightly: bytes [l][i] of the result are kv_buffers[l][token_rows[i]].

    Returns the packed prefix of `pack`, [num_layers, len(token_rows), row_bytes] bytes.
    """
    if not kv_buffers:
        raise ValueError("need at least one MLA buffer")
    first = kv_buffers[0]
    row_bytes = first[0].numel() * first.element_size()
    if pack.device != first.device:
        raise ValueError(f"MLA buffers are on {first.device} but the pack is on {pack.device}")
    if pack.dtype != torch.uint8 or pack.dim() != 1:
        raise ValueError("the pack is a flat uint8 buffer from init_dcp_pack_buffers")
    rows = token_rows.to(device=first.device, dtype=torch.int64)
    nbytes = len(kv_buffers) * rows.numel() * row_bytes
    if nbytes > pack.numel():
        raise ValueError(f"{rows.numel()} rows of {row_bytes} bytes do not fit the pack")
    packed = pack[:nbytes].view(len(kv_buffers), rows.numel(), row_bytes)
    buffers = [b.reshape(b.shape[0], -1).view(torch.uint8) for b in kv_buffers]
    get_backend(backend).gather(KVColumns(buffers, rows, 1, 0), packed)
    return packed


def per_token_descriptors(
    src_bases: Sequence[int], dst_bases: Sequence[int], rows: np.ndarray, row_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fallback without a pack: one write per layer and token row (same row on both sides)."""
    offsets = as_u64(np.asarray(rows, dtype=np.int64)) * np.uint64(row_bytes)
    src = (as_u64(src_bases)[:, None] + offsets[None, :]).reshape(-1)
    dst = (as_u64(dst_bases)[:, None] + offsets[None, :]).reshape(-1)
    return src, dst, np.full(src.shape, row_bytes, dtype=np.uint64)
