"""RoPE's tables: cos and sin per position, with Llama 3's frequency scaling when set.

The tables are computed once per runner in float64 and stored in float32; the rotation
itself (`ops.apply_rope`, the fused `triton_rope.py`) only reads rows of them, so every
architecture and scaling shares one rotation path. Llama 3 (`rope_type` "llama3")
rescales the inverse frequencies by wavelength against the pre-training context L:

    wavelength w = 2 pi / f      low = L / low_freq_factor      high = L / high_freq_factor
    w > low              f / factor                        (long waves: interpolated)
    w < high             f                                 (short waves: kept)
    otherwise            (1 - s) f / factor + s f,  s = (L / w - low_freq_factor)
                                                        / (high_freq_factor - low_freq_factor)
"""

from __future__ import annotations

import math

import torch

from pdctl.core import RopeSettings


def inverse_frequencies(head_dim: int, rope: RopeSettings) -> torch.Tensor:
    """[head_dim // 2] float64: theta ** (-2i / head_dim), scaled as `rope` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    base = 1.0 / (rope.theta**exponents)
    if rope.kind == "default":
        return base
    if rope.kind != "llama3":  # core.read_checkpoint_config refuses other kinds first
        raise ValueError(f"rope_type {rope.kind!r} has no tables here")
    context = rope.original_max_position
    wavelength = 2 * math.pi / base
    low, high = context / rope.low_freq_factor, context / rope.high_freq_factor
    smooth = (context / wavelength - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    scaled = torch.where(wavelength > low, base / rope.factor, base)
    medium = (wavelength >= high) & (wavelength <= low)
    return torch.where(medium, (1 - smooth) * base / rope.factor + smooth * base, scaled)


def rope_tables(
    head_dim: int, max_position: int, rope: RopeSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, head_dim // 2] in float32, computed in float64."""
    angles = torch.outer(
        torch.arange(max_position, dtype=torch.float64), inverse_frequencies(head_dim, rope)
    )
    return torch.cos(angles).float(), torch.sin(angles).float()
